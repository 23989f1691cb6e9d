"""An image part sent to a text-only model (the smoke vakforge workdir has no vision tower) is a JSON
error naming the part, from a real server on 127.0.0.1 (issue 31)."""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.serve_server import Served
from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served = Served(smoke_workdir(tmp_path_factory, "configs/vakforge.py:tiny"), slots=2, max_queue=4)
    yield served
    served.close()


def test_an_image_part_to_a_text_only_model_names_the_part(served):
    assert served.service.restored.model_cfg.vision is None
    url = "data:image/png;base64," + base64.b64encode((ROOT / "data/smoke/chat/images/shape_003.png").read_bytes()).decode()
    body = {"model": served.service.name, "messages": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120)
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["code"]) == (400, "messages[2].content[1]", "image_not_supported")
    text = httpx.post(served.url + "/v1/chat/completions", timeout=120, json={
        "model": served.service.name, "messages": [{"role": "user", "content": [{"type": "text", "text": "And this?"}]}],
        "max_tokens": 2})
    assert text.status_code == 200, text.text  # text parts alone are served
