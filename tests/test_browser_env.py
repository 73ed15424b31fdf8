"""The accessibility-tree observation and the browser env in a real headless Chromium."""

import io
import re
import sqlite3
from pathlib import Path
from urllib.parse import urlparse

import pytest
from fastapi import FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from PIL import Image

from envs import browser_env
from envs.browser_env import BrowserEnv, ChromiumNotFoundError, find_chromium
from envs.evaluators import evaluate
from envs.observation import (
    INTERACTIVE_ROLES,
    MARK_COLOUR,
    observation_text,
    render_ax_tree,
    tab_line,
)
from envs.server import SITES, SiteServers, SiteSpec
from envs.sites.common.accounts import TEST_ACCOUNT
from envs.tasks import Task

MAX_TREE_LINES = 150


def node(node_id, role, name=None, children=(), props=None, ignored=False, backend=None):
    """A CDP AX node as getFullAXTree returns it."""
    data = {
        "nodeId": str(node_id),
        "ignored": ignored,
        "role": {"type": "role", "value": role},
        "childIds": [str(c) for c in children],
        "backendDOMNodeId": node_id if backend is None else backend,
        "properties": [
            {"name": key, "value": {"type": "booleanOrUndefined", "value": value}}
            for key, value in (props or {}).items()
        ],
    }
    if name is not None:
        data["name"] = {"type": "computedString", "value": name}
    return data


def test_render_prunes_like_visualwebarena_and_keys_elements_by_backend_id():
    nodes = [
        node(1, "RootWebArea", "Home", [2, 3, 9], {"focused": True, "focusable": True}),
        node(2, "none", children=[4], ignored=True),
        node(3, "generic", "", [5, 6]),
        node(4, "link", "Blue road bike - $120", [7], {"url": "http://x/listing/1"}),
        node(5, "textbox", "Search", [], {"focused": True, "editable": "plaintext"}),
        node(6, "listitem", "", [8]),
        node(7, "StaticText", "Blue road bike - $120", [10]),
        node(8, "StaticText", "Erie, PA"),
        node(9, "paragraph", "", [11, 12]),
        node(10, "InlineTextBox", "Blue road bike - $120"),
        node(11, "StaticText", "Erie, PA"),
        node(12, "heading", "It's here", [], {"level": 2}),
    ]
    nodes[9]["backendDOMNodeId"] = None
    tree = render_ax_tree(nodes)
    assert tree.text.split("\n") == [
        "[1] RootWebArea 'Home' focused: True",
        "\t[4] link 'Blue road bike - $120'",
        "\t[5] textbox 'Search' focused: True",
        "\t[8] StaticText 'Erie, PA'",
        "\t[11] StaticText 'Erie, PA'",
        '\t[12] heading "It\'s here"',
    ]
    assert sorted(tree.elements) == [1, 4, 5, 8, 11, 12]
    assert tree.elements[4].id == 4
    assert tree.find("link", "Blue road bike - $120").id == 4
    assert tree.find("link", "Blue road bike") is None
    assert render_ax_tree([]).text == ""


def test_tab_line_and_observation_text():
    assert tab_line(["Home", "Bikes"], 1) == "Tab 0: Home | Tab 1 (current): Bikes"
    tree = render_ax_tree([node(1, "RootWebArea", "Home")])
    assert observation_text(["Home"], 0, "http://h/", tree) == (
        "Tab 0 (current): Home\nURL: http://h/\n[1] RootWebArea 'Home'"
    )


def test_find_chromium_honours_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENT_KV_CHROMIUM", "/usr/bin/chromium")
    assert find_chromium() == "/usr/bin/chromium"
    monkeypatch.setenv("AGENT_KV_CHROMIUM", str(tmp_path / "nothing"))
    with pytest.raises(ChromiumNotFoundError, match="apt-get install chromium"):
        find_chromium()


def test_missing_chromium_names_the_fix_in_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("AGENT_KV_CHROMIUM", raising=False)
    monkeypatch.setattr(browser_env, "CHROMIUM_PATHS", (str(tmp_path / "chromium"),))
    monkeypatch.setattr(browser_env, "CHROMIUM_NAMES", ())
    with pytest.raises(ChromiumNotFoundError) as caught:
        find_chromium()
    assert "\n" not in str(caught.value)
    assert "apt-get install chromium" in str(caught.value)


def make_task(start_url: str = "__CLASSIFIEDS__/", **fields) -> Task:
    return Task.model_validate(
        {
            "task_id": 1000,
            "sites": ["classifieds"],
            "start_url": start_url,
            "intent": "Explore.",
            "eval": {"eval_types": ["string_match"], "reference_answers": {"must_include": ["x"]}},
            **fields,
        }
    )


# A tiny site with a login and an outside image and link, registered only for these tests.

SIGNED_IN = "signed in as agent"


def _build_test_db(path: Path, seed: int) -> Path:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
    db.close()
    return path


def _create_test_app(db_path: Path) -> FastAPI:
    app = FastAPI()

    @app.get("/", response_class=HTMLResponse)
    def home(request: Request) -> str:
        user = request.cookies.get("session")
        status = f"signed in as {user}" if user else "not signed in"
        return f"<html><head><title>Test</title></head><body><p>{status}</p></body></html>"

    @app.post("/login")
    def login(username: str = Form(), password: str = Form()):
        if (username, password) != (TEST_ACCOUNT["username"], TEST_ACCOUNT["password"]):
            return HTMLResponse("bad login", status_code=403)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie("session", username)
        return response

    @app.get("/external", response_class=HTMLResponse)
    def external() -> str:
        return (
            "<html><head><title>External</title></head><body>"
            '<img src="http://example.com/x.png" alt="Outside image">'
            '<a href="http://example.com/">Outside</a> <a href="/">Home</a></body></html>'
        )

    return app


@pytest.fixture(scope="module")
def sites():
    """classifieds and the test site below (one Playwright per thread: one env serves both)."""
    spec = SiteSpec(
        name="testsite",
        placeholder="__TESTSITE__",
        build_template_db=_build_test_db,
        create_app=_create_test_app,
        login_path="/login",
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(SITES, "testsite", spec)
        with SiteServers(["classifieds", "testsite"]) as servers:
            yield servers


@pytest.fixture(scope="module")
def env(sites):
    with BrowserEnv(sites) as browser:
        yield browser


def element_id(observation: dict, role: str, name: str) -> int:
    """The id of the first line `[id] role 'name'` in the observation text."""
    match = re.search(rf"\[(\d+)\] {role} {re.escape(repr(name))}", observation["text"])
    assert match, f"{role} {name!r} not in observation"
    return int(match.group(1))


@pytest.mark.browser
def test_reset_returns_the_documented_observation(env, sites):
    obs = env.reset(make_task())
    assert set(obs) == {
        "text",
        "url",
        "tabs",
        "active_tab",
        "screenshot",
        "som_screenshot",
        "blocked_requests",
        "error",
    }
    assert obs["som_screenshot"] is None and obs["blocked_requests"] == []
    base = sites.url("classifieds")
    assert obs["url"] == f"{base}/" and obs["tabs"] == ["Home | Classifieds"]
    assert obs["active_tab"] == 0 and obs["error"] is None
    lines = obs["text"].split("\n")
    assert lines[0] == "Tab 0 (current): Home | Classifieds"
    assert lines[1] == f"URL: {base}/"
    assert lines[2].endswith("RootWebArea 'Home | Classifieds' focused: True")
    assert re.search(r"\[\d+\] textbox 'Search'", obs["text"])
    assert obs["screenshot"][:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.browser
@pytest.mark.parametrize(
    "path", ["/", "/category/electronics", "/search?q=bike", "/listing/58", "/seller/2"]
)
def test_pages_fit_a_small_model(env, path):
    obs = env.reset(make_task(f"__CLASSIFIEDS__{path}"))
    assert len(obs["text"].split("\n")) <= MAX_TREE_LINES


@pytest.mark.browser
def test_click_by_id_and_by_reference_navigate(env, sites):
    obs = env.reset(make_task())
    result = env.step(f"click [{element_id(obs, 'link', 'Bikes (24)')}]")
    assert result.observation["url"] == f"{sites.url('classifieds')}/category/bikes"
    assert not result.done and result.info == {"step": 1, "action": result.info["action"]}
    concrete = env.concrete_action("click [link 'Next page']")
    assert concrete == f"click [{element_id(result.observation, 'link', 'Next page')}]"
    result = env.step(
        "In summary, the next action I will perform is ```click [link 'Next page']```"
    )
    assert result.observation["url"].endswith("/category/bikes?page=2")
    assert "Showing 21-24 of 24 listings" in result.observation["text"]


@pytest.mark.browser
def test_type_replaces_the_value_and_enter_flag_controls_submission(env):
    obs = env.reset(make_task("__CLASSIFIEDS__/search?q=bike"))
    search = element_id(obs, "textbox", "Search")
    result = env.step(f"type [{search}] [road bike] [0]")
    assert result.observation["url"].endswith("/search?q=bike")
    result = env.step("press [Enter]")
    assert result.observation["url"].endswith("/search?q=road+bike")
    assert "Showing 1-4 of 4 listings" in result.observation["text"]
    result = env.step("type [textbox 'Search'] [laptop]")
    assert result.observation["url"].endswith("/search?q=laptop")


@pytest.mark.browser
def test_posting_a_comment_and_reset_restores_the_site(env):
    task = make_task("__CLASSIFIEDS__/listing/1")
    env.reset(task)
    env.step("type [textbox 'Your name'] [Ana] [0]")
    env.step("type [textbox 'Comment'] [Would you ship it?] [0]")
    result = env.step("click [button 'Post comment']")
    assert result.observation["url"].endswith("/listing/1?posted=1")
    assert "Ana on Apr 1, 2024: Would you ship it?" in result.observation["text"]
    assert "Comments (2)" in result.observation["text"]
    obs = env.reset(task)
    assert "Comments (1)" in obs["text"] and "Would you ship it?" not in obs["text"]


@pytest.mark.browser
def test_bad_targets_give_error_observations(env):
    env.reset(make_task())
    result = env.step("click [999999]")
    assert not result.done
    assert result.observation["error"].startswith("no element with id [999999]")
    assert result.observation["text"].startswith("ERROR: no element with id [999999]")
    result = env.step("click [link 'No such link']")
    assert result.observation["error"] == "no element [link 'No such link'] on the current page"
    heading = element_id(result.observation, "heading", "Welcome to Classifieds")
    result = env.step(f"type [{heading}] [hello]")
    assert "cannot take text input" in result.observation["error"]


@pytest.mark.browser
def test_goto_reaches_only_the_local_sites(env, sites):
    env.reset(make_task())
    result = env.step("goto [https://example.com/]")
    assert result.observation["error"].startswith("goto is limited to the local sites")
    assert result.observation["url"] == f"{sites.url('classifieds')}/"
    result = env.step("goto [__CLASSIFIEDS__/listing/2]")
    assert result.observation["error"] is None
    assert result.observation["url"] == f"{sites.url('classifieds')}/listing/2"
    result = env.step("goto [/seller/1]")
    assert result.observation["url"] == f"{sites.url('classifieds')}/seller/1"


@pytest.mark.browser
def test_history_hover_scroll_and_keys(env):
    obs = env.reset(make_task())
    env.step(f"click [{element_id(obs, 'link', 'Books (20)')}]")
    assert env.step("go_back").observation["url"].endswith("/")
    assert env.step("go_forward").observation["url"].endswith("/category/books")
    result = env.step("hover [link 'Price: low to high']")
    assert result.observation["error"] is None
    assert env.step("scroll [down]").observation["error"] is None
    assert env.page.evaluate("window.scrollY") > 0
    env.step("scroll [up]")
    assert env.page.evaluate("window.scrollY") == 0
    env.step("type [textbox 'Search'] [bikes] [0]")
    env.step("press [Backspace]")
    assert env.step("press [Enter]").observation["url"].endswith("/search?q=bike")


@pytest.mark.browser
def test_tabs_open_focus_and_close(env):
    obs = env.reset(make_task("__CLASSIFIEDS__/listing/1 |AND| __CLASSIFIEDS__/listing/2"))
    assert obs["tabs"] == ["Blue road bike | Classifieds", "2013 Volkswagen Golf | Classifieds"]
    assert obs["active_tab"] == 0
    assert obs["text"].startswith(
        "Tab 0 (current): Blue road bike | Classifieds | Tab 1: 2013 Volkswagen Golf | Classifieds"
    )
    result = env.step("tab_focus [1]")
    assert result.observation["active_tab"] == 1 and "Price: $7,400" in result.observation["text"]
    assert env.step("tab_focus [5]").observation["error"] == "no tab 5: open tabs are 0-1"
    result = env.step("new_tab")
    assert result.observation["active_tab"] == 2 and result.observation["url"] == "about:blank"
    result = env.step("goto [__CLASSIFIEDS__/seller/1]")
    assert result.observation["tabs"][2] == "Maria Lopez | Classifieds"
    result = env.step("close_tab")
    assert len(result.observation["tabs"]) == 2 and result.observation["active_tab"] == 1


@pytest.mark.browser
def test_three_parse_failures_in_a_row_end_the_episode(env):
    env.reset(make_task())
    assert not env.step("hmm").done
    assert not env.step("scroll [down]").done
    first = env.step("what now")
    assert not first.done and "Could not parse an action" in first.observation["error"]
    assert not env.step("???").done
    result = env.step("I give up")
    assert result.done and result.info["reason"] == "parse_failures"
    after = env.step("click [1]")
    assert after.done and after.info["reason"] == "episode_over"
    assert "the episode is over" in after.observation["error"]


@pytest.mark.browser
def test_five_identical_actions_end_the_episode(env):
    env.reset(make_task())
    results = [env.step("scroll [down]") for _ in range(5)]
    assert [r.done for r in results] == [False, False, False, False, True]
    assert results[-1].info["reason"] == "repeated_action"


@pytest.mark.browser
def test_stop_returns_the_answer(env):
    env.reset(make_task())
    result = env.step("stop [$120]")
    assert result.done and result.answer == "$120" and result.info["reason"] == "stop"


@pytest.mark.browser
def test_read_page_reads_the_last_tab_or_a_new_one_for_program_html(env, sites):
    env.reset(make_task("__CLASSIFIEDS__/listing/1"))
    assert "Blue road bike" in env.read_page("last")
    assert env.read_page("last", "document.title") == "Blue road bike | Classifieds"
    assert env.read_page("last", "document.querySelector('#nothing')") == ""
    assert env.read_page("last", "document.querySelector('#nothing').textContent") == ""
    assert env.read_page("last", "1 + 1") == "2"
    assert env.read_page("last", "document.querySelector('h1')") == "Blue road bike"
    assert env.read_page("last", "({price: 120})") == '{"price":120}'
    assert env.read_page("last", "(((") == ""
    text = env.read_page("__CLASSIFIEDS__/listing/2", "document.title")
    assert text == "2013 Volkswagen Golf | Classifieds"
    assert len(env.page.context.pages) == 1 and env.url.endswith("/listing/1")
    with pytest.raises(ValueError, match="not on a served site"):
        env.read_page("http://example.com/", "")
    task = make_task(
        "__CLASSIFIEDS__/listing/1",
        eval={
            "eval_types": ["program_html"],
            "program_html": [
                {"url": "last", "required_contents": {"must_include": ["$120"]}},
                {
                    "url": "__CLASSIFIEDS__/listing/2",
                    "locator": "document.querySelector('h1').textContent",
                    "required_contents": {"exact_match": "2013 Volkswagen Golf"},
                },
            ],
        },
    )
    assert evaluate(task, None, env.url, sites, env.read_page).score == 1.0
    env.step("goto [__CLASSIFIEDS__/listing/3]")
    assert evaluate(task, None, env.url, sites, env.read_page).score == 0.0


def test_site_task(start_url: str = "__TESTSITE__/", **fields) -> Task:
    return make_task(start_url, sites=["testsite"], **fields)


test_site_task.__test__ = False


@pytest.mark.browser
def test_require_login_starts_signed_in(env):
    obs = env.reset(test_site_task(require_login=True))
    assert SIGNED_IN in obs["text"]
    obs = env.reset(test_site_task(require_login=False))
    assert "not signed in" in obs["text"]


@pytest.mark.browser
def test_login_failure_is_an_error(env, monkeypatch):
    monkeypatch.setattr(browser_env, "TEST_ACCOUNT", {"username": "agent", "password": "wrong"})
    with pytest.raises(RuntimeError, match=r"login to testsite at .*/login failed: HTTP 403"):
        env.reset(test_site_task(require_login=True))


@pytest.mark.browser
def test_only_the_served_sites_are_reachable(env):
    env = env
    base = env.servers.url("testsite")
    obs = env.reset(test_site_task("__TESTSITE__/external"))
    assert ("http://example.com/x.png", "image") in env.blocked_requests
    assert ("http://example.com/x.png", "image") in obs["blocked_requests"]
    finished: list[str] = []
    failed: list[tuple[str, str]] = []
    env.page.context.on("requestfinished", lambda request: finished.append(request.url))
    env.page.context.on(
        "requestfailed", lambda request: failed.append((request.url, request.failure))
    )
    result = env.step("goto [__TESTSITE__/external]")
    assert result.observation["error"] is None
    assert result.info["blocked_requests"] == [("http://example.com/x.png", "image")]
    assert result.observation["blocked_requests"] == [("http://example.com/x.png", "image")]
    result = env.step("click [link 'Outside']")
    assert result.observation["error"].startswith("http://example.com/ is blocked")
    assert result.observation["text"].startswith("ERROR: http://example.com/ is blocked")
    assert result.observation["url"] == f"{base}/external"
    assert ("http://example.com/", "document") in result.info["blocked_requests"]
    result = env.step("goto [http://example.com/]")
    assert result.observation["error"].startswith("goto is limited to the local sites")
    assert env.step("click [link 'Home']").observation["url"] == f"{base}/"
    assert finished and all(urlparse(url).hostname == "127.0.0.1" for url in finished)
    assert failed and all(f.startswith("net::ERR_BLOCKED_BY_CLIENT") for _, f in failed)
    assert {urlparse(url).hostname for url, _ in failed} == {"example.com"}
    assert {urlparse(url).hostname for url, _ in env.blocked_requests} == {"example.com"}


@pytest.mark.browser
def test_unknown_observation_mode_is_rejected(sites):
    with pytest.raises(ValueError, match="unknown observation mode 'pixels'"):
        BrowserEnv(sites, observation="pixels")


@pytest.mark.browser
def test_set_of_marks_boxes_each_interactive_element_in_the_viewport(env, monkeypatch):
    monkeypatch.setattr(env, "observation_mode", "som")
    obs = env.reset(make_task())
    plain, marked = obs["screenshot"], obs["som_screenshot"]
    assert marked[:8] == b"\x89PNG\r\n\x1a\n" and marked != plain
    image = Image.open(io.BytesIO(marked)).convert("RGB")
    assert image.size == Image.open(io.BytesIO(plain)).size == env.viewport
    marks = env.marks(plain)
    lines = obs["text"].split("\n")
    assert lines[0] == "Tab 0 (current): Home | Classifieds" and lines[1].startswith("URL: ")
    assert lines[2:] == [f"[{m.element.id}] {m.element.role} {m.element.name!r}" for m in marks]
    assert all(m.element.role in INTERACTIVE_ROLES for m in marks)
    assert any(m.element.role == "textbox" for m in marks)
    in_view = env.page.evaluate(
        """() => [...document.querySelectorAll(
                'a[href], button, input:not([type=hidden]), select, textarea')]
            .map((e) => e.getBoundingClientRect())
            .filter((r) => r.width > 0 && r.height > 0 && r.bottom > 0 && r.right > 0
                && r.top < innerHeight && r.left < innerWidth).length"""
    )
    assert len(marks) == in_view
    all_interactive = [e for e in env.tree.elements.values() if e.role in INTERACTIVE_ROLES]
    assert 0 < len(marks) < len(all_interactive)  # the page is taller than the viewport
    for mark in marks:
        left, top, right, bottom = mark.box
        x = int(left) + 1 if left >= 1 else int(left)
        assert image.getpixel((x, int((top + bottom) / 2))) == MARK_COLOUR
    result = env.step("click [link 'Bikes (24)']")
    assert result.observation["error"] is None
    assert result.observation["url"].endswith("/category/bikes")
