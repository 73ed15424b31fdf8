"""The classifieds web application: FastAPI routes over a SQLite database, Jinja2 pages.

Pages (all HTML, at most PAGE_SIZE listings each so the accessibility tree stays short):

- `GET /` — categories with counts and the most recent listings
- `GET /category/{slug}?sort=&page=` — one category; sort is `newest`, `price_asc` or `price_desc`
- `GET /search?q=&sort=&page=` — listings whose title or description contains every word of q
- `GET /listing/{id}` — one listing with its photo, details, comments and a comment form
- `POST /listing/{id}/comments` (form fields `author`, `body`) — adds a comment, then 303 to the
  listing page with `?posted=1`, which shows "Your comment was posted."
- `GET /seller/{id}?page=` — a seller's listings
- `GET /image/{id}.png` — the listing photo (see `images.py`)
"""

import math
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from envs.sites.classifieds.data import SITE_TODAY
from envs.sites.classifieds.images import render_listing_image

PAGE_SIZE = 20
"""Listings per page on category, search and seller pages."""
RECENT_COUNT = 8
"""Listings shown under "Recent listings" on the home page."""
SORTS = {
    "newest": ("Newest first", "l.posted DESC, l.id DESC"),
    "price_asc": ("Price: low to high", "l.price ASC, l.id ASC"),
    "price_desc": ("Price: high to low", "l.price DESC, l.id ASC"),
}
"""sort parameter -> (link text, SQL ORDER BY clause)."""
MAX_COMMENT_CHARS = 500

_HERE = Path(__file__).parent
_LISTING_COLUMNS = (
    "l.id, l.title, l.price, l.location, l.posted, l.description, l.colour,"
    " c.slug AS category_slug, c.name AS category_name, s.id AS seller_id, s.name AS seller_name"
)
_LISTING_JOIN = (
    "listings l JOIN categories c ON c.id = l.category_id JOIN sellers s ON s.id = l.seller_id"
)


def _money(value: int) -> str:
    """Whole dollars as shown on the site: 12500 -> '$12,500'."""
    return f"${value:,}"


def _date(value: str) -> str:
    """An ISO date as shown on the site: '2024-03-28' -> 'Mar 28, 2024'."""
    year, month, day = (int(part) for part in value.split("-"))
    names = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()
    return f"{names[month - 1]} {day}, {year}"


def _list_url(base_url: str, params: dict, sort: str = "newest", page: int = 1) -> str:
    """URL of a list page without default sort and page: '/category/bikes?sort=price_asc'."""
    query = dict(params)
    if sort != "newest":
        query["sort"] = sort
    if page != 1:
        query["page"] = page
    return f"{base_url}?{urlencode(query)}" if query else base_url


def _page_of(db: sqlite3.Connection, where: str, params: list, sort: str, page: int) -> dict:
    """One page of listings matching `where`: {listings, page, pages, total, first, last}."""
    order = SORTS.get(sort, SORTS["newest"])[1]
    total = db.execute(f"SELECT COUNT(*) FROM {_LISTING_JOIN} WHERE {where}", params).fetchone()[0]
    pages = max(1, math.ceil(total / PAGE_SIZE))
    page = min(max(1, page), pages)
    rows = db.execute(
        f"SELECT {_LISTING_COLUMNS} FROM {_LISTING_JOIN} WHERE {where} ORDER BY {order}"
        " LIMIT ? OFFSET ?",
        [*params, PAGE_SIZE, (page - 1) * PAGE_SIZE],
    ).fetchall()
    first = (page - 1) * PAGE_SIZE + 1 if total else 0
    return {
        "listings": rows,
        "page": page,
        "pages": pages,
        "total": total,
        "first": first,
        "last": first + len(rows) - 1 if rows else 0,
    }


def create_app(db_path: str | Path) -> FastAPI:
    """The classifieds FastAPI app reading and writing the SQLite file at `db_path`.

    Each request opens its own connection, so the file may be replaced between requests
    (that is how `envs.server.SiteServer.reset` restores the template).
    """
    db_path = Path(db_path)
    app = FastAPI(title="Classifieds", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=_HERE / "static"), name="static")
    templates = Jinja2Templates(directory=_HERE / "templates")
    templates.env.filters["money"] = _money
    templates.env.filters["date"] = _date
    templates.env.globals["list_url"] = _list_url

    def get_db() -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(db_path, check_same_thread=False)
        db.row_factory = sqlite3.Row
        try:
            yield db
        finally:
            db.close()

    Db = Annotated[sqlite3.Connection, Depends(get_db)]

    def render(request: Request, db: sqlite3.Connection, name: str, status: int = 200, **ctx):
        nav = db.execute("SELECT slug, name FROM categories ORDER BY id").fetchall()
        ctx.setdefault("q", "")
        return templates.TemplateResponse(
            request, name, {"nav": nav, "sorts": SORTS, **ctx}, status_code=status
        )

    def not_found(request: Request, db: sqlite3.Connection, what: str) -> HTMLResponse:
        return render(request, db, "not_found.html", status=404, title=f"{what} not found")

    @app.get("/", response_class=HTMLResponse)
    def home(request: Request, db: Db):
        categories = db.execute(
            "SELECT c.slug, c.name, COUNT(l.id) AS n FROM categories c"
            " LEFT JOIN listings l ON l.category_id = c.id GROUP BY c.id ORDER BY c.id"
        ).fetchall()
        recent = db.execute(
            f"SELECT {_LISTING_COLUMNS} FROM {_LISTING_JOIN} ORDER BY {SORTS['newest'][1]} LIMIT ?",
            [RECENT_COUNT],
        ).fetchall()
        return render(request, db, "home.html", title="Home", categories=categories, recent=recent)

    @app.get("/category/{slug}", response_class=HTMLResponse)
    def category(request: Request, db: Db, slug: str, sort: str = "newest", page: int = 1):
        row = db.execute("SELECT id, slug, name FROM categories WHERE slug = ?", [slug]).fetchone()
        if row is None:
            return not_found(request, db, "Category")
        result = _page_of(db, "l.category_id = ?", [row["id"]], sort, page)
        return render(
            request,
            db,
            "list.html",
            title=row["name"],
            heading=row["name"],
            base_url=f"/category/{slug}",
            extra_params={},
            sort=sort if sort in SORTS else "newest",
            **result,
        )

    @app.get("/search", response_class=HTMLResponse)
    def search(request: Request, db: Db, q: str = "", sort: str = "newest", page: int = 1):
        words = q.split()
        if not words:
            return render(request, db, "search_empty.html", title="Search")
        clause = "(l.title LIKE ? ESCAPE '\\' OR l.description LIKE ? ESCAPE '\\')"
        where = " AND ".join([clause] * len(words))
        params = [value for word in words for value in (_like(word), _like(word))]
        result = _page_of(db, where, params, sort, page)
        return render(
            request,
            db,
            "list.html",
            title=f"Search: {q}",
            heading=f"Search results for \u201c{q}\u201d",
            base_url="/search",
            extra_params={"q": q},
            sort=sort if sort in SORTS else "newest",
            q=q,
            **result,
        )

    @app.get("/listing/{listing_id}", response_class=HTMLResponse)
    def listing(request: Request, db: Db, listing_id: int, posted: int = 0, error: str = ""):
        row = db.execute(
            f"SELECT {_LISTING_COLUMNS} FROM {_LISTING_JOIN} WHERE l.id = ?", [listing_id]
        ).fetchone()
        if row is None:
            return not_found(request, db, "Listing")
        comments = db.execute(
            "SELECT author, body, posted FROM comments WHERE listing_id = ? ORDER BY posted, id",
            [listing_id],
        ).fetchall()
        return render(
            request,
            db,
            "listing.html",
            title=row["title"],
            listing=row,
            comments=comments,
            posted=bool(posted),
            error="Comment cannot be empty." if error else "",
        )

    @app.post("/listing/{listing_id}/comments")
    def post_comment(
        request: Request,
        db: Db,
        listing_id: int,
        body: Annotated[str, Form()] = "",
        author: Annotated[str, Form()] = "",
    ):
        exists = db.execute("SELECT 1 FROM listings WHERE id = ?", [listing_id]).fetchone()
        if exists is None:
            return not_found(request, db, "Listing")
        body = " ".join(body.split())[:MAX_COMMENT_CHARS]
        if not body:
            return RedirectResponse(f"/listing/{listing_id}?error=empty", status_code=303)
        author = " ".join(author.split())[:60] or "Guest"
        with db:
            db.execute(
                "INSERT INTO comments (listing_id, author, body, posted) VALUES (?, ?, ?, ?)",
                [listing_id, author, body, SITE_TODAY.isoformat()],
            )
        return RedirectResponse(f"/listing/{listing_id}?posted=1", status_code=303)

    @app.get("/seller/{seller_id}", response_class=HTMLResponse)
    def seller(request: Request, db: Db, seller_id: int, sort: str = "newest", page: int = 1):
        row = db.execute("SELECT id, name, member_since FROM sellers WHERE id = ?", [seller_id])
        row = row.fetchone()
        if row is None:
            return not_found(request, db, "Seller")
        result = _page_of(db, "l.seller_id = ?", [seller_id], sort, page)
        return render(
            request,
            db,
            "list.html",
            title=row["name"],
            heading=f"Listings by {row['name']}",
            subheading=f"Member since {_date(row['member_since'])}",
            base_url=f"/seller/{seller_id}",
            extra_params={},
            sort=sort if sort in SORTS else "newest",
            **result,
        )

    @app.get("/image/{listing_id}.png")
    def image(request: Request, db: Db, listing_id: int):
        row = db.execute(
            "SELECT l.title, l.colour, c.slug FROM listings l"
            " JOIN categories c ON c.id = l.category_id WHERE l.id = ?",
            [listing_id],
        ).fetchone()
        if row is None:
            return Response(status_code=404)
        png = render_listing_image(row["slug"], row["colour"], row["title"])
        return Response(png, media_type="image/png")

    return app


def _like(word: str) -> str:
    """A LIKE pattern matching `word` literally anywhere (`%`, `_` and `\\` escaped)."""
    escaped = word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"
