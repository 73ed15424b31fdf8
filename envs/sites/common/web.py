"""The FastAPI + Jinja2 + SQLite scaffold every bundled site is built on, and its page helpers:
display filters, list URLs, LIKE patterns and pagination."""

import math
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

PAGE_SIZE = 20
"""Rows per page on every list page of every site."""
_MONTHS = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()


def money_dollars(value: int) -> str:
    """Whole dollars as shown on a site: 12500 -> '$12,500'."""
    return f"${value:,}"


def money_cents(cents: int) -> str:
    """Cents as shown on a site: 123456 -> '$1,234.56'."""
    return f"${cents // 100:,}.{cents % 100:02d}"


def site_date(value: str) -> str:
    """An ISO date or timestamp as shown on a site: '2024-03-28T14:05' -> 'Mar 28, 2024'.

    Raises:
        ValueError: `value` does not start with YYYY-MM-DD.
    """
    year, month, day = (int(part) for part in value[:10].split("-"))
    return f"{_MONTHS[month - 1]} {day}, {year}"


def list_url_for(default_sort: str) -> Callable[..., str]:
    """The `list_url(base_url, params, sort, page)` template global of a site whose list pages
    sort by `default_sort`: it leaves out a default sort and page 1, e.g.
    '/category/bikes?sort=price_asc'."""

    def list_url(base_url: str, params: dict, sort: str = default_sort, page: int = 1) -> str:
        query = dict(params)
        if sort != default_sort:
            query["sort"] = sort
        if page != 1:
            query["page"] = page
        return f"{base_url}?{urlencode(query)}" if query else base_url

    return list_url


def like(word: str) -> str:
    """A LIKE pattern (for `ESCAPE '\\'`) matching `word` literally anywhere."""
    escaped = word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def words_clause(q: str, columns: tuple[str, ...]) -> tuple[str, list[str]]:
    """SQL WHERE text and parameters matching rows where every word of `q` is in one of
    `columns` (trusted SQL names). Empty `q` gives ('', [])."""
    words = q.split()
    clause = "(" + " OR ".join(f"{col} LIKE ? ESCAPE '\\'" for col in columns) + ")"
    params = [like(word) for word in words for _ in columns]
    return " AND ".join([clause] * len(words)), params


def clamp_page(total: int, page: int, page_size: int = PAGE_SIZE) -> tuple[int, int]:
    """(page, pages): `page` brought into 1..pages for `total` rows (always at least 1 page)."""
    pages = max(1, math.ceil(total / page_size))
    return min(max(1, page), pages), pages


def page_result(key: str, rows: list, page: int, pages: int, total: int, page_size: int) -> dict:
    """A list page's template context: {key: rows, page, pages, total, first, last}, where
    first and last number the shown rows from 1 (0 when there are none)."""
    first = (page - 1) * page_size + 1 if total else 0
    return {
        key: rows,
        "page": page,
        "pages": pages,
        "total": total,
        "first": first,
        "last": first + len(rows) - 1 if rows else 0,
    }


def sql_page(
    db: sqlite3.Connection,
    key: str,
    select: str,
    where: str,
    params: list,
    order: str,
    page: int,
    page_size: int = PAGE_SIZE,
) -> dict:
    """One page of `SELECT {select} WHERE {where} ORDER BY {order}` as `page_result(key, ...)`;
    `select` is the columns and FROM part ('a, b FROM t'). Out-of-range pages are clamped."""
    tables = select.split(" FROM ", 1)[1]
    total = db.execute(f"SELECT COUNT(*) FROM {tables} WHERE {where}", params).fetchone()[0]
    page, pages = clamp_page(total, page, page_size)
    rows = db.execute(
        f"SELECT {select} WHERE {where} ORDER BY {order} LIMIT ? OFFSET ?",
        [*params, page_size, (page - 1) * page_size],
    ).fetchall()
    return page_result(key, rows, page, pages, total, page_size)


def list_page(key: str, rows: list, page: int, page_size: int = PAGE_SIZE) -> dict:
    """One page of already sorted `rows` as `page_result(key, ...)` (page clamped)."""
    page, pages = clamp_page(len(rows), page, page_size)
    shown = rows[(page - 1) * page_size : page * page_size]
    return page_result(key, shown, page, pages, len(rows), page_size)


def create_site_app(
    title: str,
    site_dir: Path,
    db_path: str | Path,
    pages: "Pages",
) -> tuple[FastAPI, Any]:
    """The scaffold of a site: (app, Db).

    `app` is a FastAPI app without docs pages serving `site_dir/static` at `/static`; `pages`
    renders `site_dir/templates`; `Db` is the route parameter annotation giving each request
    its own connection (rows as sqlite3.Row) to the SQLite file at `db_path`, closed after the
    response, so the file may be replaced between requests (that is how
    `envs.server.SiteServer.reset` restores the template).
    """
    db_path = Path(db_path)
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=site_dir / "static"), name="static")
    pages.load(site_dir / "templates")

    def get_db() -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(db_path, check_same_thread=False)
        db.row_factory = sqlite3.Row
        try:
            yield db
        finally:
            db.close()

    return app, Annotated[sqlite3.Connection, Depends(get_db)]


PageOf = Callable[[sqlite3.Connection, str, list, str, int], dict]
"""A site's `page_of(db, where, params, sort, page)`: one page of its list rows."""


class Pages:
    """Renders a site's templates with what every page needs: the `nav` rows, the `sorts`
    table and `q` (the search box, '' by default), plus whatever `extra` adds; and its list
    and search pages (template `list.html`) through `page_of`."""

    templates: Jinja2Templates

    def __init__(
        self,
        nav_sql: str,
        sorts: dict,
        page_of: PageOf,
        filters: dict[str, Callable] | None = None,
        extra: Callable[[Request, sqlite3.Connection, dict], dict] | None = None,
    ):
        """`nav_sql` selects the navigation rows; the first key of `sorts` is the default
        sort; `filters` are the site's Jinja2 filters besides `date` (`site_date`);
        `extra(request, db, ctx)` returns the context to render with (e.g. adding the
        signed-in user). Templates come with `load`."""
        self.nav_sql = nav_sql
        self.sorts = sorts
        self.default_sort = next(iter(sorts))
        self.page_of = page_of
        self.filters = {"date": site_date, **(filters or {})}
        self.extra = extra

    def load(self, directory: Path) -> Jinja2Templates:
        """Load the templates in `directory` with the filters and the `list_url` global
        (`list_url_for` the default sort); returns them (also kept as `templates`)."""
        self.templates = Jinja2Templates(directory=directory)
        self.templates.env.filters.update(self.filters)
        self.templates.env.globals["list_url"] = list_url_for(self.default_sort)
        return self.templates

    def render(
        self, request: Request, db: sqlite3.Connection, name: str, status: int = 200, **ctx
    ) -> HTMLResponse:
        """Template `name` rendered with `ctx` and the common context, as `status`."""
        nav = db.execute(self.nav_sql).fetchall()
        if self.extra is not None:
            ctx = self.extra(request, db, ctx)
        ctx.setdefault("q", "")
        return self.templates.TemplateResponse(
            request, name, {"nav": nav, "sorts": self.sorts, **ctx}, status_code=status
        )

    def not_found(self, request: Request, db: sqlite3.Connection, what: str) -> HTMLResponse:
        """The 404 page titled '<what> not found'."""
        return self.render(request, db, "not_found.html", status=404, title=f"{what} not found")

    def list_page(
        self,
        request: Request,
        db: sqlite3.Connection,
        where: str,
        params: list,
        sort: str,
        page: int,
        base_url: str,
        extra_params: dict,
        **ctx,
    ) -> HTMLResponse:
        """`list.html` with one page of the rows matching `where` (unknown sorts become the
        default), linking pages to `base_url` with `extra_params`; `ctx` adds to the page."""
        sort = sort if sort in self.sorts else self.default_sort
        result = self.page_of(db, where, params, sort, page)
        return self.render(
            request,
            db,
            "list.html",
            base_url=base_url,
            extra_params=extra_params,
            sort=sort,
            **ctx,
            **result,
        )

    def search(
        self,
        request: Request,
        db: sqlite3.Connection,
        q: str,
        columns: tuple[str, ...],
        sort: str,
        page: int,
    ) -> HTMLResponse:
        """The `/search` page: rows with every word of `q` in one of `columns`, or
        `search_empty.html` when `q` has no words."""
        if not q.split():
            return self.render(request, db, "search_empty.html", title="Search")
        where, params = words_clause(q, columns)
        return self.list_page(
            request,
            db,
            where,
            params,
            sort,
            page,
            "/search",
            {"q": q},
            title=f"Search: {q}",
            heading=f"Search results for \u201c{q}\u201d",
            q=q,
        )


def add_search_route(
    app: FastAPI, pages: Pages, Db: Any, columns: tuple[str, ...], default_sort: str
) -> None:
    """Add `GET /search?q=&sort=&page=` to `app`: `pages.search` over `columns`, sorted by
    `default_sort` when no sort is given."""

    @app.get("/search", response_class=HTMLResponse)
    def search(request: Request, db: Db, q: str = "", sort: str = default_sort, page: int = 1):
        return pages.search(request, db, q, columns, sort, page)


def add_category_routes(
    app: FastAPI, pages: Pages, Db: Any, where: str, search_columns: tuple[str, ...]
) -> None:
    """Add `GET /category/{slug}?sort=&page=` (the rows matching `where`, whose one parameter
    is the id of the `categories` row with that slug; 404 page for an unknown slug) and
    `add_search_route` over `search_columns` to `app`."""

    default = pages.default_sort

    @app.get("/category/{slug}", response_class=HTMLResponse)
    def category(request: Request, db: Db, slug: str, sort: str = default, page: int = 1):
        row = db.execute("SELECT id, slug, name FROM categories WHERE slug = ?", [slug]).fetchone()
        if row is None:
            return pages.not_found(request, db, "Category")
        return pages.list_page(
            request,
            db,
            where,
            [row["id"]],
            sort,
            page,
            f"/category/{slug}",
            {},
            title=row["name"],
            heading=row["name"],
        )

    add_search_route(app, pages, Db, search_columns, default)


def add_picture_route(
    app: FastAPI, Db: Any, table: str, draw: Callable[[str, str, str], bytes]
) -> None:
    """Add `GET /image/{id}.png` to `app`: `draw(category slug, colour, title)` of row `id` of
    `table` (which has `title`, `colour` and `category_id` columns), or an empty 404."""

    @app.get("/image/{item_id}.png")
    def image(db: Db, item_id: int):
        row = db.execute(
            f"SELECT t.title, t.colour, c.slug FROM {table} t"
            " JOIN categories c ON c.id = t.category_id WHERE t.id = ?",
            [item_id],
        ).fetchone()
        if row is None:
            return Response(status_code=404)
        return Response(draw(row["slug"], row["colour"], row["title"]), media_type="image/png")
