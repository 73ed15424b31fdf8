"""The action grammar: every kind, prose, fences, element references and garbage."""

import pytest

from envs.actions import ACTION_GRAMMAR, Action, ActionParseError, ElementRef, parse_action


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("click [12]", Action("click", element_id=12)),
        ("hover [7]", Action("hover", element_id=7)),
        (
            "type [5] [red bike] [0]",
            Action("type", element_id=5, text="red bike", press_enter=False),
        ),
        ("type [5] [red bike] [1]", Action("type", element_id=5, text="red bike")),
        ("type [5] [red bike]", Action("type", element_id=5, text="red bike")),
        ("press [Enter]", Action("press", key="Enter")),
        ("press [ctrl+a]", Action("press", key="Control+a")),
        ("press [PageDown]", Action("press", key="PageDown")),
        ("scroll [down]", Action("scroll", direction="down")),
        ("scroll up", Action("scroll", direction="up")),
        ("new_tab", Action("new_tab")),
        ("tab_focus [2]", Action("tab_focus", tab_index=2)),
        ("close_tab", Action("close_tab")),
        (
            "goto [http://127.0.0.1:8000/search?q=bike]",
            Action("goto", url="http://127.0.0.1:8000/search?q=bike"),
        ),
        ("go_back", Action("go_back")),
        ("go_forward", Action("go_forward")),
        ("stop [$120]", Action("stop", answer="$120")),
        ("stop [ N/A ]", Action("stop", answer="N/A")),
        ("stop", Action("stop", answer="")),
    ],
)
def test_every_action_kind_parses(text, expected):
    assert parse_action(text) == expected


def test_every_kind_in_the_grammar_is_covered_and_round_trips():
    samples = [
        "click [1]",
        "type [1] [x] [0]",
        "hover [1]",
        "press [Enter]",
        "scroll [down]",
        "new_tab",
        "tab_focus [0]",
        "close_tab",
        "goto [http://127.0.0.1/]",
        "go_back",
        "go_forward",
        "stop [done]",
    ]
    assert {parse_action(s).kind for s in samples} == set(ACTION_GRAMMAR)
    for sample in samples:
        assert str(parse_action(sample)) == sample


def test_action_inside_fences_after_the_answer_phrase():
    reply = (
        "Let's think step-by-step. The search box is [5]. I could click [9] but typing is better. "
        "In summary, the next action I will perform is ```type [5] [road bike] [1]```"
    )
    assert parse_action(reply) == Action("type", element_id=5, text="road bike")


def test_fenced_block_with_language_tag_and_brackets_in_text():
    assert parse_action("```text\ntype [3] [arr[0]] [0]\n```") == Action(
        "type", element_id=3, text="arr[0]", press_enter=False
    )
    assert parse_action("Answer:\n```\nstop [$1,100]\n```") == Action("stop", answer="$1,100")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I will click [12] to open it.", Action("click", element_id=12)),
        ("Click [12]", Action("click", element_id=12)),
        (
            "The price is shown. stop [$120] because the page says so.",
            Action("stop", answer="$120"),
        ),
        ("I should not stop yet. go_back", Action("go_back")),
        ("type [5] [a] [1] and then click [3]", Action("type", element_id=5, text="a")),
        ("We need to scroll down to see more.", Action("scroll", direction="down")),
        ("Nothing left to do, so stop.", Action("stop", answer="")),
    ],
)
def test_prose_around_the_action_is_tolerated(text, expected):
    assert parse_action(text) == expected


def test_element_references_by_role_and_name():
    action = parse_action("click [link 'Blue road bike - $120']")
    assert action.element_ref == ElementRef("link", "Blue road bike - $120")
    assert action.element_id is None
    assert str(action) == "click [link 'Blue road bike - $120']"
    typed = parse_action('type [textbox "Men\'s name"] [Ana] [0]')
    assert typed.element_ref == ElementRef("textbox", "Men's name")
    assert typed.text == "Ana" and not typed.press_enter


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "hello there",
        "click here",
        "click [abc]",
        "type [5]",
        "tab_focus [first]",
        "goto []",
        "scroll sideways",
        "I am not going to stop now",
        "``` ```",
    ],
)
def test_garbage_raises_with_the_grammar_in_the_message(text):
    with pytest.raises(ActionParseError) as caught:
        parse_action(text)
    message = str(caught.value)
    assert "click [id]" in message and "type [id] [text] [0|1]" in message
    assert "stop [answer]" in message


def test_unknown_key_names_the_key():
    with pytest.raises(ActionParseError, match="unknown key 'Foo'"):
        parse_action("press [Foo]")


def test_parse_error_is_a_value_error():
    assert issubclass(ActionParseError, ValueError)
