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

from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from envs.sites.classifieds.data import SITE_TODAY
from envs.sites.classifieds.images import render_listing_image
from envs.sites.common.web import (
    PAGE_SIZE,
    Pages,
    add_category_routes,
    add_picture_route,
    create_site_app,
    money_dollars,
    site_date,
    sql_page,
)

__all__ = ["PAGE_SIZE", "create_app"]

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
_NAV = "SELECT slug, name FROM categories ORDER BY id"
_LISTING_JOIN = (
    "listings l JOIN categories c ON c.id = l.category_id JOIN sellers s ON s.id = l.seller_id"
)


def _page_of(db, where: str, params: list, sort: str, page: int) -> dict:
    """One page of listings matching `where`: {listings, page, pages, total, first, last}."""
    order = SORTS.get(sort, SORTS["newest"])[1]
    select = f"{_LISTING_COLUMNS} FROM {_LISTING_JOIN}"
    return sql_page(db, "listings", select, where, params, order, page)


def create_app(db_path: str | Path) -> FastAPI:
    """The classifieds FastAPI app reading and writing the SQLite file at `db_path`.

    Each request opens its own connection, so the file may be replaced between requests
    (that is how `envs.server.SiteServer.reset` restores the template).
    """
    pages = Pages(_NAV, SORTS, _page_of, {"money": money_dollars})
    app, Db = create_site_app("Classifieds", _HERE, db_path, pages)
    render, not_found = pages.render, pages.not_found

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

    add_category_routes(app, pages, Db, "l.category_id = ?", ("l.title", "l.description"))

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
        return pages.list_page(
            request,
            db,
            "l.seller_id = ?",
            [seller_id],
            sort,
            page,
            f"/seller/{seller_id}",
            {},
            title=row["name"],
            heading=f"Listings by {row['name']}",
            subheading=f"Member since {site_date(row['member_since'])}",
        )

    add_picture_route(app, Db, "listings", render_listing_image)

    return app
