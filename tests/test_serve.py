"""``headmech serve`` (:mod:`headmech.publish.serve`): the page's answers on any text
against the model's own pattern, the pattern scores by hand, bad input as a one-line 400
(never a server error), localhost by default, and the page in Chromium on SmolLM2."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request

import pytest
import torch

import headmech
from headmech.core.errors import InputError
from headmech.interventions import capture
from headmech.publish.serve import MAX_TOKENS, render, start, text_scores
from headmech.stream.engine import ProbeBatch


@pytest.fixture(scope="module")
def toy():
    return headmech.load_model("toy-induction")


@pytest.fixture(scope="module")
def server(toy):
    s = start(toy, "toy-induction")
    yield s
    s.stop()


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_text_scores_by_hand():
    ids = [0, 5, 6, 5, 6]
    p = torch.zeros(5, 5)
    p[0, 0] = 1
    p[1, 0] = 1
    p[2, 1] = 1  # previous token
    p[3, 2] = 0.5  # token after the earlier copy of 5 (at 1): 2
    p[3, 1] = 0.5  # the earlier copy itself
    p[4, 3] = 1  # previous token, and the earlier copy of 6 (at 2) is not attended
    s = text_scores(ids, p)
    assert s["previous_token"] == pytest.approx((1 + 1 + 0.5 + 1) / 4)
    assert s["duplicate_token"] == pytest.approx((0.5 + 0) / 2)
    assert s["induction"] == pytest.approx((0.5 + 1) / 2)  # query 4: key 3 follows copy 2
    assert s["attention_sink"] == pytest.approx(1 / 4)


def test_a_head_and_a_layer_on_any_text(toy):
    text = "t1 t2 t3 t4 t1 t2 t3"
    out = render(toy, text, "L1H0")
    ids = toy.tokenizer(text, add_special_tokens=True)["input_ids"]
    assert len(out["tokens"]) == len(ids) and list(out["scores"]) == ["L1H0"]
    t = torch.tensor([ids])
    p = capture(toy, ProbeBatch(t, torch.ones_like(t), torch.zeros_like(t, dtype=torch.bool)),
                ["blocks.1.attn.hook_pattern"])["blocks.1.attn.hook_pattern"][0, 0]  # fmt: skip
    assert out["scores"]["L1H0"] == pytest.approx(text_scores(ids, p))
    assert out["scores"]["L1H0"]["induction"] > 0.5  # the toy's induction head, on new text
    assert 'class="hm-view"' in out["html"] and '<div class="writes">' in out["html"]
    layer = render(toy, text, "L0")
    assert list(layer["scores"]) == [f"L0H{h}" for h in range(int(toy.cfg.n_heads))]
    assert layer["html"].count('class="hm-view"') == int(toy.cfg.n_heads)


@pytest.mark.parametrize(
    ("text", "what", "said"),
    [
        ("", "L0H0", "type a text"),
        ("   ", "L0H0", "type a text"),
        ("t1 t2", "head 3", "name a head as L3H1"),
        ("t1 t2", "L9H0", "layer 9 is outside"),
        ("t1 t2", "L0H9", "head 9 is outside"),
        (" ".join(["t1"] * (MAX_TOKENS + 5)), "L0H0", f"at most {MAX_TOKENS}"),
    ],
)
def test_bad_input_is_one_line(toy, text, what, said):
    with pytest.raises(InputError, match=said):
        render(toy, text, what)


def test_the_server_answers_on_localhost_and_never_with_a_server_error(server):
    assert server.url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(server.url, timeout=60) as r:
        assert r.status == 200 and b"any text, any head" in r.read()
    q = urllib.parse.urlencode({"text": "t1 t2 t1", "head": "L1H0"})
    status, out = _get(server.url + "api/view?" + q)
    assert status == 200 and out["tokens"] and "hm-view" in out["html"]
    for bad in ({"text": "", "head": "L1H0"}, {"text": "t1", "head": "x"}, {"head": "L1H0"}):
        status, out = _get(server.url + "api/view?" + urllib.parse.urlencode(bad))
        assert status == 400 and "\n" not in out["error"] and out["error"]


def test_serve_refuses_a_mistyped_model_in_one_line(capsys):
    from headmech.cli import main

    assert main(["serve", "smollm3-135m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "smollm2-135m" in err[0]


@pytest.mark.slow
def test_the_page_in_chromium_on_smollm2(smollm2):
    """Type a text, name a head: its view, what it writes and its scores appear; a bad
    head is a message on the page; no script error."""
    from playwright.sync_api import sync_playwright
    from test_site import NO_BROWSER, find_chromium

    chromium = find_chromium()
    if chromium is None:
        if os.environ.get("HEADMECH_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{NO_BROWSER} (HEADMECH_REQUIRE_BROWSER=1)", pytrace=False)
        pytest.skip(NO_BROWSER)
    s = start(smollm2, "smollm2-135m")
    text = "The cat sat on the mat. The cat sat on the"
    try:
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=str(chromium), args=["--no-sandbox"])
            page = b.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(s.url)
            page.fill("#text", text)
            page.fill("#head", "L18H6")
            page.click("button[type=submit]")
            page.wait_for_selector("#out .hm-view")
            n = len(smollm2.tokenizer(text, add_special_tokens=True)["input_ids"])
            assert page.locator("#out .hm-view .hm-tok").count() == n
            assert page.locator("#out .writes").count() == 1
            assert "L18H6" in page.locator("#out table.scores").inner_text()
            page.locator("#out .hm-view .hm-tok").last.click()  # the view's own script runs
            assert page.locator("#out .hm-view").get_attribute("data-pinned") == str(n - 1)
            page.fill("#head", "L99H0")
            page.click("button[type=submit]")
            page.wait_for_selector("#status.error")
            assert "layer 99 is outside" in page.locator("#status").inner_text()
            assert not errors
            b.close()
    finally:
        s.stop()
