"""The accessibility-tree observation and the browser env in a real headless Chromium."""

import re

import pytest

from envs import browser_env
from envs.browser_env import BrowserEnv, ChromiumNotFoundError, find_chromium
from envs.observation import observation_text, render_ax_tree, tab_line
from envs.server import SiteServers
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


def make_task(start_url: str = "__CLASSIFIEDS__/") -> Task:
    return Task.model_validate(
        {
            "task_id": 1000,
            "sites": ["classifieds"],
            "start_url": start_url,
            "intent": "Explore.",
            "eval": {"eval_types": ["string_match"], "reference_answers": {"must_include": ["x"]}},
        }
    )


@pytest.fixture(scope="module")
def sites():
    with SiteServers(["classifieds"]) as servers:
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
    assert set(obs) == {"text", "url", "tabs", "active_tab", "screenshot", "error"}
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
