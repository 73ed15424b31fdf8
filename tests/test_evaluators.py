"""Evaluators on crafted cases: string_match variants, url_match, evaluate's product."""

from types import SimpleNamespace

import pytest

from envs.evaluators import (
    EvalResult,
    clean_answer,
    evaluate,
    fuzzy_match,
    normalise,
    occurs,
    string_match,
    url_match,
    url_matches,
)
from envs.tasks import Task

SITES = {"__CLASSIFIEDS__": "http://127.0.0.1:8123"}


def make_task(**eval_fields) -> Task:
    return Task.model_validate(
        {
            "task_id": 99,
            "sites": ["classifieds"],
            "start_url": "__CLASSIFIEDS__/",
            "intent": "crafted",
            "eval": eval_fields,
        }
    )


def score(refs: dict, answer: str | None) -> float:
    return string_match(refs, answer)[0]


def test_clean_answer_strips_quotes_and_case():
    assert clean_answer('  "Blue Road Bike" ') == "blue road bike"
    assert clean_answer("'x'") == "x"
    assert clean_answer("it's") == "it's"


def test_exact_match():
    assert score({"exact_match": "Clothing"}, "clothing") == 1.0
    assert score({"exact_match": "Clothing"}, " 'Clothing' ") == 1.0
    assert score({"exact_match": "Clothing"}, "Clothing category") == 0.0


def test_must_include_with_or_alternatives():
    refs = {"must_include": ["Aisha |OR| Khan", "Erie"]}
    assert score(refs, "Khan, from Erie") == 1.0
    assert score(refs, "Aisha in Erie, PA") == 1.0
    assert score(refs, "Aisha in Akron") == 0.0
    assert score({"must_include": ["5 |OR| five"]}, "Five listings") == 1.0


def test_numbers_do_not_match_inside_longer_numbers():
    assert occurs("120", "$120")
    assert occurs("120", "It costs $120.00.")
    assert not occurs("12", "$120")
    assert not occurs("20", "$120")
    assert not occurs("1", "$1,100")
    assert occurs("1,100", "$1,100")
    assert not occurs("5", "5.5")


def test_references_match_whole_words_only():
    assert score({"must_include": ["correct"]}, "incorrect") == 0.0
    assert score({"must_include": ["yes"]}, "eyes") == 0.0
    assert not occurs("Lee", "Leeds") and not occurs("road bike", "road biker")
    assert not occurs("gear", "gear_grinder")  # the underscore is part of the word
    assert score({"must_include": ["yes"]}, "Yes, it is") == 1.0
    assert score({"must_include": ["correct"]}, "correct.") == 1.0
    assert score({"one_of": ["no", "yes"]}, "(yes)") == 1.0
    assert occurs("Aisha Khan", "Sold by Aisha Khan, Erie")
    assert not occurs("Aisha Khan", "Aisha Khanh")
    tent = {"must_include": ["Trailpeak camping tent", "132"]}
    assert score(tent, "Trailpeak camping tent, $132.00") == 1.0
    assert occurs("Weekly thread: synthesizers", '"Weekly thread: synthesizers"')


def test_punctuation_at_a_reference_end_is_matched_as_written():
    assert occurs("$45", "It is $45.") and occurs("$45", "US$45") and not occurs("$45", "$450")
    assert occurs("$45", "$45.00 each") and not occurs("$45", "$45.50")
    assert occurs("Ann Lee.", "The seller is Ann Lee.") and not occurs("Ann Lee.", "Ann Lee")
    assert not occurs("Ann Lee.", "Joann Lee.")
    assert occurs("Comments (1)", "Comments (1)") and not occurs("Comments (1)", "Comments (12)")


def test_must_exclude_drops_only_whole_words():
    refs = {"must_include": ["headphones"], "must_exclude": ["phone", "e-bike"]}
    assert score(refs, "studio headphones") == 1.0
    assert score(refs, "studio headphones and an e-bike") == 0.0
    assert score(refs, "headphones, not a phone") == 0.0


def test_must_exclude():
    refs = {"must_include": ["Red"], "must_exclude": ["Green", "dresser"]}
    assert score(refs, "Red bookshelf") == 1.0
    assert score(refs, "Red dresser") == 0.0
    assert score(refs, "red or green") == 0.0


def test_one_of():
    refs = {"one_of": ["Erie", "Akron"]}
    assert score(refs, "akron, oh") == 1.0
    assert score(refs, "Buffalo") == 0.0


def test_fuzzy_match_is_normalised_equality_or_whole_word_containment():
    assert normalise("  Is THIS still-available?? ") == "is this still available"
    assert fuzzy_match("Is this still available", "is this still available?")
    assert fuzzy_match("Aisha Khan", "The seller is Aisha Khan.")
    assert not fuzzy_match("Aisha Khan", "Aisha Khanh")
    assert not fuzzy_match("Aisha Khan", "Khan Aisha")
    assert score({"fuzzy_match": ["Aisha Khan", "Erie"]}, "Aisha Khan from Erie") == 1.0
    assert score({"fuzzy_match": ["Aisha Khan", "Erie"]}, "Aisha Khan") == 0.0
    assert score({"fuzzy_match": "N/A"}, "n/a") == 1.0


def test_no_answer_scores_zero():
    assert string_match({"must_include": ["x"]}, None) == (
        0.0,
        {"answer": None, "reason": "no answer"},
    )


def test_url_match_gold_in_pred_compares_paths_and_parsed_queries():
    ref = "http://h/category/bikes?sort=price_desc"
    assert url_matches(ref, "http://h/category/bikes?page=1&sort=price_desc")
    assert url_matches(ref, "HTTP://H/category/bikes/?sort=price_desc")
    assert not url_matches(ref, "http://h/category/bikes")
    assert not url_matches(ref, "http://h/category/bikes?sort=price_asc")
    assert url_matches("http://h/listing/1", "http://h/listing/1?posted=1")
    assert not url_matches("http://h/listing/1", "http://h/listing/12")
    assert url_matches("http://h/search?q=road+bike", "http://h/search?q=road%20bike")


def test_url_match_exact():
    assert url_matches("http://h/a?x=1&y=2", "http://h/a/?y=2&x=1", "EXACT")
    assert not url_matches("http://h/a?x=1", "http://h/a?x=1&y=2", "EXACT")
    with pytest.raises(ValueError, match="unknown url_note"):
        url_matches("http://h/a", "http://h/a", "FUZZY")


def test_url_match_substitutes_placeholders_and_accepts_or():
    ref = "__CLASSIFIEDS__/listing/3 |OR| __CLASSIFIEDS__/listing/4"
    assert url_match(ref, "http://127.0.0.1:8123/listing/4", "GOLD in PRED", SITES)[0] == 1.0
    assert url_match(ref, "http://127.0.0.1:8123/listing/5", "GOLD in PRED", SITES)[0] == 0.0
    assert url_match(ref, "http://127.0.0.1:9999/listing/4", "GOLD in PRED", SITES)[0] == 0.0


def test_evaluate_multiplies_the_evaluators():
    task = make_task(
        eval_types=["string_match", "url_match"],
        reference_answers={"must_include": ["4"]},
        reference_url="__CLASSIFIEDS__/listing/58?posted=1",
    )
    good = evaluate(task, "4", "http://127.0.0.1:8123/listing/58?posted=1", SITES)
    assert isinstance(good, EvalResult) and good.score == 1.0
    assert good.details["string_match"]["score"] == 1.0
    assert good.details["url_match"]["score"] == 1.0
    wrong_url = evaluate(task, "4", "http://127.0.0.1:8123/listing/58", SITES)
    assert wrong_url.score == 0.0 and wrong_url.details["string_match"]["score"] == 1.0
    assert evaluate(task, "3", "http://127.0.0.1:8123/listing/58?posted=1", SITES).score == 0.0


def test_evaluate_takes_the_placeholders_of_running_sites():
    sites = SimpleNamespace(placeholders={"__CLASSIFIEDS__": "http://local"})  # as SiteServers
    task = make_task(eval_types=["url_match"], reference_url="__CLASSIFIEDS__/listing/1")
    assert evaluate(task, None, "http://local/listing/1", sites).score == 1.0
    assert evaluate(task, None, "http://other/listing/1", sites).score == 0.0


def test_zero_cents_match_on_both_sides_and_versions_are_kept():
    assert (
        occurs("$45.00", "$45.00") and occurs("$45", "It costs $45.00") and occurs("$45.00", "$45")
    )
    assert occurs("2.0", "version 2.0") and not occurs("10.1", "10.0.1")


def test_no_reference_answers_scores_zero():
    assert string_match({}, "anything")[0] == 0.0


def program_html_task(*checks: dict, **eval_fields) -> Task:
    return make_task(eval_types=["program_html"], program_html=list(checks), **eval_fields)


def test_program_html_scores_each_check_on_the_text_read_and_multiplies():
    pages = {
        ("last", ""): "Your cart\nBlue road bike $120\nTotal: $120",
        ("http://127.0.0.1:8123/listing/58", "document.title"): "Orange desk | Classifieds",
    }
    calls = []

    def read_page(url: str, locator: str) -> str:
        calls.append((url, locator))
        return pages.get((url, locator), "")

    task = program_html_task(
        {"url": "last", "locator": "", "required_contents": {"must_include": ["road bike"]}},
        {
            "url": "__CLASSIFIEDS__/listing/58",
            "locator": "document.title",
            "required_contents": {"exact_match": "Orange desk | Classifieds"},
        },
    )
    result = evaluate(task, None, "http://127.0.0.1:8123/", SITES, read_page)
    assert result.score == 1.0
    assert calls == [("last", ""), ("http://127.0.0.1:8123/listing/58", "document.title")]
    checks = result.details["program_html"]["checks"]
    assert [check["score"] for check in checks] == [1.0, 1.0]
    assert checks[1]["url"] == "http://127.0.0.1:8123/listing/58"

    task = program_html_task(
        {"url": "last", "required_contents": {"must_include": ["road bike"]}},
        {"url": "last", "required_contents": {"must_exclude": ["$120"]}},
    )
    result = evaluate(task, None, "", SITES, read_page)
    assert result.score == 0.0
    assert [c["score"] for c in result.details["program_html"]["checks"]] == [1.0, 0.0]


def test_program_html_uses_the_string_match_rules_and_multiplies_with_string_match():
    def read_page(url: str, locator: str) -> str:
        return "Comments (4)\nRiley: Is the price negotiable?"

    task = program_html_task(
        {
            "url": "last",
            "required_contents": {"must_include": ["4 |OR| four"], "fuzzy_match": ["negotiable"]},
        },
        reference_answers={"must_include": ["4"]},
    )
    task.eval.eval_types.append("string_match")
    assert evaluate(task, "4", "", SITES, read_page).score == 1.0
    assert evaluate(task, "5", "", SITES, read_page).score == 0.0
    strict = program_html_task({"url": "last", "required_contents": {"must_include": ["1"]}})
    assert evaluate(strict, None, "", SITES, read_page).score == 0.0  # "1" is not in "(4)"


def test_program_html_without_a_page_reader_is_an_error():
    task = program_html_task({"url": "last", "required_contents": {"must_include": ["x"]}})
    with pytest.raises(ValueError, match="program_html needs read_page"):
        evaluate(task, None, "", SITES)
