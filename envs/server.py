"""Serve the bundled sites in-process: one uvicorn thread per site on 127.0.0.1.

`SITES` registers each site (name, URL placeholder, template-DB builder, app factory); adding a
site (shopping, forum) means adding an entry. `SiteServer` serves one site from a working copy
of its template database and restores that copy with `reset()`; `SiteServers` holds several and
substitutes placeholders such as `__CLASSIFIEDS__` in task URLs.

    with SiteServers(["classifieds"]) as sites:
        sites.substitute("__CLASSIFIEDS__/search?q=bike")  # 'http://127.0.0.1:PORT/search?q=bike'
        sites.reset(["classifieds"])                       # back to the seeded data
"""

import shutil
import socket
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from envs.lifecycle import Closing
from envs.sites import classifieds, forum, shopping


@dataclass(frozen=True)
class SiteSpec:
    """A servable site.

    Attributes:
        name: the site's name in task files' `sites` lists, e.g. "classifieds".
        placeholder: the token tasks use for its base URL, e.g. "__CLASSIFIEDS__".
        build_template_db: `(path, seed) -> path`, writes the seeded SQLite template.
        create_app: `(db_path) -> FastAPI`, the app serving that database.
        login_path: where the site takes `POST` form fields `username` and `password` (the
            fixed `TEST_ACCOUNT`) and sets its session cookie, for tasks with
            `require_login`; None for a site without accounts.
    """

    name: str
    placeholder: str
    build_template_db: Callable[[Path, int], Path]
    create_app: Callable[[Path], FastAPI]
    login_path: str | None = None


SITES: dict[str, SiteSpec] = {
    "classifieds": SiteSpec(
        name="classifieds",
        placeholder="__CLASSIFIEDS__",
        build_template_db=classifieds.build_template_db,
        create_app=classifieds.create_app,
    ),
    "shopping": SiteSpec(
        name="shopping",
        placeholder="__SHOPPING__",
        build_template_db=shopping.build_template_db,
        create_app=shopping.create_app,
        login_path="/login",
    ),
    "forum": SiteSpec(
        name="forum",
        placeholder="__FORUM__",
        build_template_db=forum.build_template_db,
        create_app=forum.create_app,
        login_path="/login",
    ),
}
"""All bundled sites by name."""

START_TIMEOUT_S = 10.0


def replace_placeholders(text: str, placeholders: Mapping[str, str]) -> str:
    """`text` with each placeholder (e.g. `__CLASSIFIEDS__`) replaced by its base URL."""
    for placeholder, url in placeholders.items():
        text = text.replace(placeholder, url)
    return text


class SiteServer(Closing):
    """One site served by uvicorn in a background thread on 127.0.0.1 and a free port.

    The template database is built once into a private temporary directory and copied to a
    working database that the app reads and writes; `reset()` copies the template back
    (SQLite backup API, a few milliseconds). Use as a context manager or call `close()`.

    Raises:
        KeyError: unknown site name.
        RuntimeError: the server did not start within START_TIMEOUT_S seconds.
    """

    def __init__(self, name: str, seed: int = 0) -> None:
        if name not in SITES:
            raise KeyError(f"unknown site {name!r}: bundled sites are {sorted(SITES)}")
        self.spec = SITES[name]
        self._tmp = tempfile.TemporaryDirectory(prefix=f"agent_kv_{name}_")
        tmp = Path(self._tmp.name)
        self.template_db = self.spec.build_template_db(tmp / "template.db", seed)
        self.db_path = tmp / "site.db"
        shutil.copyfile(self.template_db, self.db_path)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port: int = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.spec.create_app(self.db_path),
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=f"site-{name}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                self.close()
                raise RuntimeError(f"site {name!r} did not start on {self.url}")
            time.sleep(0.005)

    @property
    def name(self) -> str:
        """The site's registered name."""
        return self.spec.name

    def reset(self) -> None:
        """Restore the working database to the template (all posted data is lost)."""
        with sqlite3.connect(self.template_db) as src, sqlite3.connect(self.db_path) as dst:
            src.backup(dst)
        src.close()
        dst.close()

    def close(self) -> None:
        """Stop the server thread and delete the databases; safe to call twice."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=START_TIMEOUT_S)
        self._tmp.cleanup()


class SiteServers(Closing):
    """Several `SiteServer`s (default: every site in `SITES`) and their URL placeholders.

    Raises:
        KeyError: a name not in `SITES`.
    """

    def __init__(self, names: Iterable[str] | None = None, seed: int = 0) -> None:
        self.servers: dict[str, SiteServer] = {}
        try:
            for name in SITES if names is None else names:
                if name not in self.servers:
                    self.servers[name] = SiteServer(name, seed=seed)
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> dict[str, str]:
        """Site name -> base URL, e.g. {"classifieds": "http://127.0.0.1:41234"}."""
        return {name: server.url for name, server in self.servers.items()}

    @property
    def placeholders(self) -> dict[str, str]:
        """Placeholder -> base URL, e.g. {"__CLASSIFIEDS__": "http://127.0.0.1:41234"}."""
        return {server.spec.placeholder: server.url for server in self.servers.values()}

    def url(self, name: str) -> str:
        """Base URL of site `name` (KeyError if it is not served)."""
        return self.servers[name].url

    def substitute(self, text: str) -> str:
        """`text` with every served site's placeholder replaced by that site's base URL."""
        return replace_placeholders(text, self.placeholders)

    def owns(self, url: str) -> bool:
        """Whether `url` is on one of the served sites (same scheme, host and port)."""
        return any(
            url == base or url.startswith((base + "/", base + "?")) for base in self.urls.values()
        )

    def reset(self, names: Iterable[str] | None = None) -> None:
        """Restore the databases of sites `names` (default: all served sites).

        Raises:
            KeyError: a site that is not served here.
        """
        for name in self.servers if names is None else names:
            if name not in self.servers:
                raise KeyError(f"site {name!r} is not served: serving {sorted(self.servers)}")
            self.servers[name].reset()

    def close(self) -> None:
        """Stop every server; safe to call twice."""
        for server in self.servers.values():
            server.close()
