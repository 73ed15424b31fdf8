"""The forum web application: FastAPI routes over a SQLite database, Jinja2 pages.

Pages (all HTML, at most PAGE_SIZE posts each so the accessibility tree stays short):

- `GET /` — the forums with their descriptions and post counts
- `GET /f/{slug}?sort=&page=` — one forum's posts; sort is `hot` (default), `new` or `top`
- `GET /f/{slug}/{id}` — one post: body, score, vote buttons, comments (replies nested one
  level under their comment) and a comment form
- `GET /search?q=&sort=&page=` — posts whose title or body contains every word of q
- `GET /user/{username}?page=` — a user's karma, posts and comments
- `GET /login`, `POST /login` (form fields `username`, `password`, `next`) — sets the session
  cookie and 303s to `next`; `POST /logout` clears it
- `GET /submit?forum=`, `POST /submit` (fields `forum`, `title`, `body`) — a new post, then 303
  to its page with `?submitted=1`
- `POST /f/{slug}/{id}/comment` (field `body`) — a new comment, then 303 to the post with
  `?commented=1`
- `POST /vote` (fields `target` = post or comment, `id`, `direction` = up or down, `next`) —
  casts the logged-in user's vote; the same vote again takes it back

Submitting, commenting and voting need a login: without one they 303 to `/login?next=...`.
The session cookie is the username signed with HMAC, so it survives a database reset.
"""

import datetime as dt
import hmac
import sqlite3
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

from fastapi import FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from envs.sites.common.accounts import SessionCookie, login_redirect, safe_next
from envs.sites.common.web import (
    PAGE_SIZE,
    Pages,
    add_search_route,
    clamp_page,
    create_site_app,
    list_page,
)
from envs.sites.forum.data import SITE_NOW, password_hash

__all__ = ["PAGE_SIZE", "SESSION_COOKIE", "create_app"]

SORTS = {"hot": "Hot", "new": "New", "top": "Top"}
"""sort parameter -> link text; `hot` is score / (age in hours + 2) ** 1.5."""
SESSION_COOKIE = "forum_session"
_SESSION = SessionCookie(SESSION_COOKIE, b"agent-kv-forum-session", ":")
MAX_TITLE_CHARS = 200
MAX_BODY_CHARS = 5000

_HERE = Path(__file__).parent
_POST_COLUMNS = (
    "p.id, p.title, p.body, p.created, p.score, f.slug AS forum_slug, f.name AS forum_name,"
    " u.username AS author,"
    " (SELECT COUNT(*) FROM comments c WHERE c.post_id = p.id) AS n_comments"
)
_NAV = "SELECT slug, name FROM forums ORDER BY id"
_POST_JOIN = "posts p JOIN forums f ON f.id = p.forum_id JOIN users u ON u.id = p.user_id"
_ORDER = {"new": "p.created DESC, p.id DESC", "top": "p.score DESC, p.id ASC"}


def _points(value: int) -> str:
    """A score as shown on the site: 1 -> '1 point', 12 -> '12 points'."""
    return f"{value} point" if abs(value) == 1 else f"{value} points"


def _hotness(score: int, created: str) -> float:
    """The `hot` rank of a post: score / (age in hours + 2) ** 1.5, age against SITE_NOW."""
    age = (SITE_NOW - dt.datetime.fromisoformat(created)).total_seconds() / 3600
    return score / (max(0.0, age) + 2) ** 1.5


def _page_of(db: sqlite3.Connection, where: str, params: list, sort: str, page: int) -> dict:
    """One page of posts matching `where`: {posts, page, pages, total, first, last}."""
    rows = db.execute(
        f"SELECT {_POST_COLUMNS} FROM {_POST_JOIN} WHERE {where}"
        f" ORDER BY {_ORDER.get(sort, _ORDER['new'])}",
        params,
    ).fetchall()
    if sort not in _ORDER:
        rows.sort(key=lambda row: -_hotness(row["score"], row["created"]))
    return list_page("posts", rows, page)


def _with_user(request: Request, db: sqlite3.Connection, ctx: dict) -> dict:
    """Page context plus the signed-in `user` (unless given)."""
    ctx.setdefault("user", _SESSION.current_user(request, db, "id, username"))
    return ctx


def create_app(db_path: str | Path) -> FastAPI:
    """The forum FastAPI app reading and writing the SQLite file at `db_path`.

    Each request opens its own connection, so the file may be replaced between requests
    (that is how `envs.server.SiteServer.reset` restores the template).
    """
    pages = Pages(_NAV, SORTS, _page_of, {"points": _points}, _with_user)
    app, Db = create_site_app("Forum", _HERE, db_path, pages)
    render, not_found = pages.render, pages.not_found

    def current_user(request: Request, db: sqlite3.Connection) -> sqlite3.Row | None:
        return _SESSION.current_user(request, db, "id, username")

    @app.get("/", response_class=HTMLResponse)
    def home(request: Request, db: Db):
        forums = db.execute(
            "SELECT f.slug, f.name, f.description, COUNT(p.id) AS n FROM forums f"
            " LEFT JOIN posts p ON p.forum_id = f.id GROUP BY f.id ORDER BY f.id"
        ).fetchall()
        return render(request, db, "home.html", title="Home", forums=forums)

    @app.get("/f/{slug}", response_class=HTMLResponse)
    def forum(request: Request, db: Db, slug: str, sort: str = "hot", page: int = 1):
        row = db.execute("SELECT * FROM forums WHERE slug = ?", [slug]).fetchone()
        if row is None:
            return not_found(request, db, "Forum")
        return pages.list_page(
            request,
            db,
            "f.id = ?",
            [row["id"]],
            sort,
            page,
            f"/f/{slug}",
            {},
            title=f"/f/{slug}",
            heading=row["name"],
            subheading=row["description"],
            forum=row,
        )

    add_search_route(app, pages, Db, ("p.title", "p.body"), "new")

    @app.get("/f/{slug}/{post_id}", response_class=HTMLResponse)
    def post(
        request: Request,
        db: Db,
        slug: str,
        post_id: int,
        commented: int = 0,
        submitted: int = 0,
        error: str = "",
    ):
        row = db.execute(
            f"SELECT {_POST_COLUMNS} FROM {_POST_JOIN} WHERE p.id = ? AND f.slug = ?",
            [post_id, slug],
        ).fetchone()
        if row is None:
            return not_found(request, db, "Post")
        user = current_user(request, db)
        votes = {}
        if user is not None:
            votes = {
                (v["target"], v["target_id"]): v["value"]
                for v in db.execute("SELECT * FROM votes WHERE user_id = ?", [user["id"]])
            }
        comments = db.execute(
            "SELECT c.id, c.parent_id, c.body, c.created, c.score, u.username AS author"
            " FROM comments c JOIN users u ON u.id = c.user_id WHERE c.post_id = ?"
            " ORDER BY c.created, c.id",
            [post_id],
        ).fetchall()
        replies: dict[int, list] = {}
        for c in comments:
            if c["parent_id"] is not None:
                replies.setdefault(c["parent_id"], []).append(c)
        return render(
            request,
            db,
            "post.html",
            title=row["title"],
            post=row,
            comments=[c for c in comments if c["parent_id"] is None],
            replies=replies,
            votes=votes,
            user=user,
            commented=bool(commented),
            submitted=bool(submitted),
            error="Comment cannot be empty." if error else "",
        )

    @app.post("/f/{slug}/{post_id}/comment")
    def comment(
        request: Request, db: Db, slug: str, post_id: int, body: Annotated[str, Form()] = ""
    ):
        url = f"/f/{slug}/{post_id}"
        exists = db.execute(
            "SELECT 1 FROM posts p JOIN forums f ON f.id = p.forum_id"
            " WHERE p.id = ? AND f.slug = ?",
            [post_id, slug],
        ).fetchone()
        if exists is None:
            return not_found(request, db, "Post")
        user = current_user(request, db)
        if user is None:
            return login_redirect(url)
        body = " ".join(body.split())[:MAX_BODY_CHARS]
        if not body:
            return RedirectResponse(f"{url}?error=empty", status_code=303)
        with db:
            db.execute(
                "INSERT INTO comments (post_id, parent_id, user_id, body, created, score)"
                " VALUES (?, NULL, ?, ?, ?, 1)",
                [post_id, user["id"], body, SITE_NOW.isoformat(timespec="minutes")],
            )
        return RedirectResponse(f"{url}?commented=1", status_code=303)

    @app.post("/vote")
    def vote(
        request: Request,
        db: Db,
        target: Annotated[str, Form()] = "",
        id: Annotated[int, Form()] = 0,
        direction: Annotated[str, Form()] = "up",
        next: Annotated[str, Form()] = "/",
    ):
        next_path = safe_next(next)
        user = current_user(request, db)
        if user is None:
            return login_redirect(next_path)
        table = {"post": "posts", "comment": "comments"}.get(target)
        if table is None or direction not in ("up", "down"):
            return RedirectResponse(next_path, status_code=303)
        if db.execute(f"SELECT 1 FROM {table} WHERE id = ?", [id]).fetchone() is None:
            return not_found(request, db, target.capitalize())
        value = 1 if direction == "up" else -1
        key = [user["id"], target, id]
        old = db.execute(
            "SELECT value FROM votes WHERE user_id = ? AND target = ? AND target_id = ?", key
        ).fetchone()
        old_value = old["value"] if old else 0
        new_value = 0 if old_value == value else value
        with db:
            db.execute("DELETE FROM votes WHERE user_id = ? AND target = ? AND target_id = ?", key)
            if new_value:
                db.execute("INSERT INTO votes VALUES (?, ?, ?, ?)", [*key, new_value])
            db.execute(
                f"UPDATE {table} SET score = score + ? WHERE id = ?", [new_value - old_value, id]
            )
        return RedirectResponse(next_path, status_code=303)

    @app.get("/user/{username}", response_class=HTMLResponse)
    def user_page(request: Request, db: Db, username: str, page: int = 1):
        row = db.execute("SELECT * FROM users WHERE username = ?", [username]).fetchone()
        if row is None:
            return not_found(request, db, "User")
        karma = db.execute(
            "SELECT (SELECT COALESCE(SUM(score), 0) FROM posts WHERE user_id = :id)"
            " + (SELECT COALESCE(SUM(score), 0) FROM comments WHERE user_id = :id)",
            {"id": row["id"]},
        ).fetchone()[0]
        n_posts = db.execute("SELECT COUNT(*) FROM posts WHERE user_id = ?", [row["id"]])
        n_comments = db.execute("SELECT COUNT(*) FROM comments WHERE user_id = ?", [row["id"]])
        n_posts, n_comments = n_posts.fetchone()[0], n_comments.fetchone()[0]
        page, pages = clamp_page(max(n_posts, n_comments), page)
        offset = (page - 1) * PAGE_SIZE
        posts = db.execute(
            f"SELECT {_POST_COLUMNS} FROM {_POST_JOIN} WHERE p.user_id = ?"
            f" ORDER BY {_ORDER['new']} LIMIT ? OFFSET ?",
            [row["id"], PAGE_SIZE, offset],
        ).fetchall()
        comments = db.execute(
            "SELECT c.body, c.created, c.score, p.id AS post_id, p.title AS post_title,"
            " f.slug AS forum_slug FROM comments c JOIN posts p ON p.id = c.post_id"
            " JOIN forums f ON f.id = p.forum_id WHERE c.user_id = ?"
            " ORDER BY c.created DESC, c.id DESC LIMIT ? OFFSET ?",
            [row["id"], PAGE_SIZE, offset],
        ).fetchall()
        return render(
            request,
            db,
            "user.html",
            title=row["username"],
            profile=row,
            karma=karma,
            posts=posts,
            comments=comments,
            n_posts=n_posts,
            n_comments=n_comments,
            page=page,
            pages=pages,
        )

    @app.get("/login", response_class=HTMLResponse)
    def login_form(request: Request, db: Db, next: str = "/"):
        return render(request, db, "login.html", title="Log in", next=safe_next(next))

    @app.post("/login")
    def login(
        request: Request,
        db: Db,
        username: Annotated[str, Form()] = "",
        password: Annotated[str, Form()] = "",
        next: Annotated[str, Form()] = "/",
    ):
        username = username.strip()
        row = db.execute("SELECT password_hash FROM users WHERE username = ?", [username])
        row = row.fetchone()
        if row is None or not hmac.compare_digest(
            row["password_hash"], password_hash(username, password)
        ):
            return render(
                request,
                db,
                "login.html",
                status=401,
                title="Log in",
                next=safe_next(next),
                error="Wrong username or password.",
                username=username,
            )
        return _SESSION.signed_in(username, safe_next(next))

    _SESSION.add_logout_route(app)

    @app.get("/submit", response_class=HTMLResponse)
    def submit_form(request: Request, db: Db, forum: str = ""):
        if current_user(request, db) is None:
            return login_redirect(f"/submit?forum={quote(forum)}" if forum else "/submit")
        return render(request, db, "submit.html", title="Submit a new post", forum=forum)

    @app.post("/submit")
    def submit(
        request: Request,
        db: Db,
        forum: Annotated[str, Form()] = "",
        title: Annotated[str, Form()] = "",
        body: Annotated[str, Form()] = "",
    ):
        user = current_user(request, db)
        if user is None:
            return login_redirect("/submit")
        row = db.execute("SELECT id FROM forums WHERE slug = ?", [forum]).fetchone()
        title = " ".join(title.split())[:MAX_TITLE_CHARS]
        body = body.strip()[:MAX_BODY_CHARS]
        if row is None or not title:
            return render(
                request,
                db,
                "submit.html",
                status=400,
                title="Submit a new post",
                forum=forum,
                post_title=title,
                body=body,
                error="Choose a forum." if row is None else "Title cannot be empty.",
            )
        with db:
            cursor = db.execute(
                "INSERT INTO posts (forum_id, user_id, title, body, created, score)"
                " VALUES (?, ?, ?, ?, ?, 1)",
                [row["id"], user["id"], title, body, SITE_NOW.isoformat(timespec="minutes")],
            )
        return RedirectResponse(f"/f/{forum}/{cursor.lastrowid}?submitted=1", status_code=303)

    return app
