"""/health as a load balancer or a script waits on it: 503 "warming up" while a CUDA capture holds
every reply (the fake backend captures when told to, as the engine does after a load), ok once a
reply can start; a CPU compile in the background keeps it ok throughout."""
import time

from fastapi.testclient import TestClient

from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.core.events import Request
from kvchat.serve.server import create_app

from support.fake_backend import FakeBackend


def health_until(client, status: int, deadline_s: float = 30):
    end = time.monotonic() + deadline_s  # only stops a broken run from hanging
    while time.monotonic() < end:
        answer = client.get("/health")
        if answer.status_code == status:
            return answer
        time.sleep(0.02)
    raise AssertionError(f"/health never answered {status}: {answer.status_code} {answer.text}")


def test_health_says_warming_up_while_a_capture_holds_replies():
    fake = FakeBackend(EngineConfig(max_context=256))
    fake.wait_ready(30)
    try:
        client = TestClient(create_app(fake, "starter"), base_url="http://127.0.0.1")
        assert client.get("/health").json()["status"] == "ok"
        captured = fake.warm_up()
        handle = fake.submit(Request(messages=[{"role": "user", "content": "Hi"}], sampling=SamplingParams(max_new_tokens=2)))
        answer = health_until(client, 503)
        assert answer.json()["error"]["message"] == "warming up: capturing the decode step"
        captured.set()
        assert health_until(client, 200).json()["status"] == "ok"
        handle.result(30)
        fake.warm_up(background=True)  # the CPU's compile: replies never wait for it
        fake.submit(Request(messages=[{"role": "user", "content": "Hi"}], sampling=SamplingParams(max_new_tokens=2))).result(30)
        assert client.get("/health").status_code == 200
    finally:
        fake.close()
