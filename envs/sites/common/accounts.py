"""Signed-cookie login shared by the sites with accounts: the session cookie holds the
username and its HMAC, so it needs no server-side state and survives a database reset."""

import hashlib
import hmac
import sqlite3
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse

TEST_ACCOUNT = {"username": "agent", "password": "agent-kv-test"}
"""The fixed account every site with logins seeds; tasks with `require_login` start signed in."""


class SessionCookie:
    """A site's session cookie `name`, valued '<username><separator><HMAC-SHA256 hex>'."""

    def __init__(self, name: str, secret: bytes, separator: str, digest_chars: int = 64):
        """`secret` signs the cookies (fixed, so a cookie stays valid across resets and
        restarts); the hex digest is cut to `digest_chars` characters."""
        self.name = name
        self.secret = secret
        self.separator = separator
        self.digest_chars = digest_chars

    def sign(self, username: str) -> str:
        """The cookie value for `username`."""
        mac = hmac.new(self.secret, username.encode(), hashlib.sha256).hexdigest()
        return f"{username}{self.separator}{mac[: self.digest_chars]}"

    def username(self, cookie: str | None) -> str | None:
        """The username in a cookie value, or None when it is missing or forged."""
        if not cookie or self.separator not in cookie:
            return None
        username = cookie.rsplit(self.separator, 1)[0]
        return username if hmac.compare_digest(self.sign(username), cookie) else None

    def current_user(
        self, request: Request, db: sqlite3.Connection, columns: str = "*"
    ) -> sqlite3.Row | None:
        """The `users` row (`columns` of it) of the signed-in user of `request`, or None."""
        username = self.username(request.cookies.get(self.name))
        if username is None:
            return None
        return db.execute(f"SELECT {columns} FROM users WHERE username = ?", [username]).fetchone()

    def signed_in(self, username: str, target: str) -> RedirectResponse:
        """A 303 to `target` that sets the cookie for `username`."""
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(self.name, self.sign(username), httponly=True, samesite="lax")
        return response

    def add_logout_route(self, app: FastAPI) -> None:
        """Add `POST /logout` to `app`: clears the cookie and 303s to the home page."""

        @app.post("/logout")
        def logout():
            response = RedirectResponse("/", status_code=303)
            response.delete_cookie(self.name)
            return response


def safe_next(target: str, default: str = "/") -> str:
    """`target` when it is a path on this site, else `default` (no open redirects)."""
    return target if target.startswith("/") and not target.startswith("//") else default


def login_redirect(next_path: str) -> RedirectResponse:
    """303 to the login page, coming back to `next_path` afterwards."""
    return RedirectResponse(f"/login?next={quote(next_path)}", status_code=303)
