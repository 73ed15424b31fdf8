"""`agent-kv sites`: the bundled web sites served on 127.0.0.1 until Ctrl-C."""

from __future__ import annotations

import signal
from typing import Annotated

import typer

from agent_kv.cli.common import fail


def sites_command(
    sites: Annotated[
        str, typer.Option(help="Comma-separated sites (classifieds, shopping, forum), or all.")
    ] = "all",
) -> None:
    """Serve the bundled sites on 127.0.0.1, each on a free port, and print one line per site
    (name, URL, and the test account's login where the site has accounts); Ctrl-C stops them."""
    # the sites' web framework: imported by the command, not at start
    from envs.server import SITES, SiteServers
    from envs.sites.common.accounts import TEST_ACCOUNT

    names = list(SITES) if sites == "all" else [n.strip() for n in sites.split(",") if n.strip()]
    for name in names or [sites]:
        if name not in SITES:
            fail(f"unknown site {name!r}: choose all or from {', '.join(SITES)}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as Ctrl-C does
    try:
        with SiteServers(names) as servers:
            for name, url in servers.urls.items():
                line = f"{name}  {url}"
                if SITES[name].login_path is not None:
                    line += (
                        f"  (log in at {url}{SITES[name].login_path} as "
                        f"{TEST_ACCOUNT['username']} / {TEST_ACCOUNT['password']})"
                    )
                typer.echo(line)
            typer.echo("serving until Ctrl-C", err=True)
            signal.pause()
    except KeyboardInterrupt:
        pass
