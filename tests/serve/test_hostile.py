"""``kvchat serve`` under hostile load, bounded in count: huge prompts at once and one after another,
a 600 MiB body, cross-site bodies, idle connections, clients that hang up mid-body. Memory is the
server process's resident set, read from /proc; nothing here is timed (deadlines only stop a broken
run from hanging). The figures are printed: pytest -s shows them."""
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_process import kvchat_serve_process

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MiB = 1 << 20
HUGE = int(7.8 * MiB)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    with kvchat_serve_process(folder, KEY) as (url, proc):
        yield url, proc.pid, folder / "serve.log"


def status(pid: int, field: str) -> int:
    """A /proc/PID/status figure in bytes (VmRSS: resident now; VmHWM: the peak since reset)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def huge_body(endpoint: str, i: int) -> bytes:
    text = (f"request {i}: " + "the quick brown fox jumps over the lazy dog " * (HUGE // 44))[:HUGE]
    body = {"prompt": text} if endpoint == "completions" else {"messages": [{"role": "user", "content": text}]}
    return json.dumps({**body, "max_tokens": 4}).encode()


def send(url: str, endpoint: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/{endpoint}", content=body, timeout=300,
                      headers={**AUTH, "Content-Type": "application/json"})


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_eight_huge_prompts_at_once_are_refused_in_bounded_memory(server, endpoint):
    url, pid, _ = server
    bodies = [huge_body(endpoint, i) for i in range(8)]
    send(url, endpoint, huge_body(endpoint, 99))  # the first of its kind: code paths warmed
    before = status(pid, "VmRSS")
    reset_peak(pid)
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda b: send(url, endpoint, b), bodies))
    growth = status(pid, "VmHWM") - before
    print(f"\n8 concurrent 7.8 MiB prompts on /v1/{endpoint}: peak RSS growth {growth / MiB:.0f} MiB")
    assert [r.status_code for r in replies] == [400] * 8, replies[0].text
    assert all("longer than the context" in r.json()["error"]["message"] for r in replies), replies[0].text
    assert growth <= 300 * 10 ** 6


def test_twelve_huge_messages_in_a_row_leave_no_growth_after_the_first(server):
    url, pid, _ = server
    rss = []
    for i in range(12):
        r = send(url, "chat/completions", huge_body("chat", 1000 + i))
        assert r.status_code == 400, r.text
        rss.append(status(pid, "VmRSS"))
    print(f"\n12 sequential 7.8 MiB messages: RSS after the first {rss[0] / MiB:.0f} MiB, after the last "
          f"{rss[-1] / MiB:.0f} MiB (growth {(rss[-1] - rss[0]) / MiB:+.0f} MiB)")
    assert rss[-1] - rss[0] <= 50 * 10 ** 6


def body_sent_before_refusal(url: str, chunked: bool) -> tuple[int, bytes]:
    """Sends a 600 MiB body as fast as the server takes it, until the server answers or closes;
    returns the bytes sent (an upper bound on what it read) and the start of its answer."""
    host, port = url.rsplit("/", 1)[1].split(":")
    size = 600 * MiB
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {size}\r\n".encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n").encode() + framing + b"\r\n"
    block = b"x" * (64 << 10)
    piece = (f"{len(block):x}\r\n".encode() + block + b"\r\n") if chunked else block
    sent, answer = 0, b""
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head)
        s.settimeout(0.05)
        end = time.monotonic() + 120
        while sent < size and time.monotonic() < end:
            try:
                answer += s.recv(4096)
                break  # the server has answered (or closed: b"")
            except socket.timeout:
                pass
            except ConnectionError:
                break
            try:
                sent += s.send(piece)
            except socket.timeout:
                continue
            except ConnectionError:
                break
        s.settimeout(5)
        try:
            while b"\r\n\r\n" not in answer:
                more = s.recv(4096)
                if not more:
                    break
                answer += more
        except (socket.timeout, ConnectionError):
            pass
    return sent, answer


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_600_mib_body_is_refused_before_it_is_read(server, chunked):
    url, pid, _ = server
    before = status(pid, "VmRSS")
    reset_peak(pid)
    sent, answer = body_sent_before_refusal(url, chunked)
    growth = status(pid, "VmHWM") - before
    print(f"\n600 MiB body ({'chunked' if chunked else 'Content-Length'}): {sent / MiB:.1f} MiB sent before the "
          f"answer, peak RSS growth {growth / MiB:.0f} MiB")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent <= 20 * 10 ** 6 and growth <= 20 * 10 ** 6


@pytest.mark.parametrize("content_type, body", [
    ("text/plain", json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})),
    ("application/x-www-form-urlencoded", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'),
    ("multipart/form-data; boundary=x", '--x\r\nContent-Disposition: form-data; name="a"\r\n\r\n{}\r\n--x--'),
    (None, json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})),
])
def test_bodies_a_web_page_can_send_without_asking_get_415(server, content_type, body):
    url, _, _ = server
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    for endpoint in ("chat/completions", "completions"):
        r = httpx.post(f"{url}/v1/{endpoint}", content=body.encode(), headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    # and from a web page (a browser names it in Origin), refused whatever the body
    r = httpx.post(f"{url}/v1/chat/completions", content=body.encode(),
                   headers={**headers, "Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"


def test_five_hundred_idle_connections_are_closed_and_the_server_serves_on(server):
    from kvchat.serve.transport import HEAD_TIMEOUT_S

    url, _, _ = server
    host, port = url.rsplit("/", 1)[1].split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(500)]
    half = idle[:100]
    for s in half:  # half a request head, then silence
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
    start = time.monotonic()
    open_ = set(range(len(idle)))
    for s in idle:
        s.settimeout(0.01)
    while open_ and time.monotonic() < start + 20 * HEAD_TIMEOUT_S:  # a hang guard, not a figure
        for i in list(open_):
            try:
                if idle[i].recv(1024) == b"":
                    open_.discard(i)
            except socket.timeout:
                pass
            except ConnectionError:
                open_.discard(i)
        time.sleep(0.05)
    took = time.monotonic() - start
    for s in idle:
        s.close()
    print(f"\n500 idle connections (100 of them half a head): all closed by the server after {took:.1f} s "
          f"(deadline {HEAD_TIMEOUT_S:g} s)")
    assert not open_, f"{len(open_)} connections still open"
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 1}, headers=AUTH, timeout=120)
    assert r.status_code == 200


def test_clients_hanging_up_mid_body_leave_one_log_line_not_a_traceback_each(server):
    url, _, log = server
    host, port = url.rsplit("/", 1)[1].split(":")

    def hang_up(_):
        with socket.create_connection((host, int(port))) as s:
            s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
                       "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode() + b'{"messages"')

    threads = [threading.Thread(target=hang_up, args=(i,)) for i in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 1}, headers=AUTH, timeout=120)
    assert r.status_code == 200
    text = log.read_text()
    print(f"\n200 clients hung up mid-body: the log holds {len(text)} bytes")
    assert "Traceback" not in text and text.count("hung up while sending its body") <= 1, text[-2000:]


def test_two_hundred_thousand_one_character_messages_are_refused_and_the_next_request_is_served(server):
    """A 5.9 MiB body of one-character messages, under the body limit: before the cap, the trim
    (quadratic in the count) held the engine thread for minutes and every other client with it."""
    url, _, _ = server
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(200_000)]
    reply = send(url, "chat/completions", json.dumps({"messages": messages, "max_tokens": 1}).encode())
    assert reply.status_code == 400, reply.text
    assert "2048" in reply.json()["error"]["message"], reply.text
    after = send(url, "chat/completions", json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 1, "temperature": 0}).encode())
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 1, after.text


@pytest.mark.parametrize("head", ["Content-Length: -1", "Content-Length: 12, 13", "Transfer-Encoding: gzip"])
def test_a_request_http_cannot_parse_gets_the_apis_json_error(server, head):
    """h11 refuses these before the app sees them; uvicorn answered in plain text, which an OpenAI
    client cannot read as an error."""
    url, _, _ = server
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n{head}\r\n\r\n{{}}".encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head_part, _, body = answer.partition(b"\r\n\r\n")
    assert head_part.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"content-type: application/json" in head_part.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("malformed HTTP request")


def test_the_model_id_is_one_word_a_client_can_pass_on(server):
    """Issue 49 point 14: /v1/models said "starter (SmolLM2-135M-Instruct)", spaces and brackets
    that a client pasting it into a URL or a command line broke on."""
    url, _, _ = server
    models = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]
    one = httpx.get(f"{url}/v1/models/SmolLM2-135M-Instruct", headers=AUTH, timeout=30)
    assert one.status_code == 200 and one.json()["id"] == "SmolLM2-135M-Instruct"
