"""The RL loop's serving side while the trainer refits (`train.py`; rank 0 only): client
threads sending completions back to back, the engine's own token counter, and the check
that every request saw exactly one committed version.

- `Client`: `threads` threads, each sending `/v1/completions` of the fixed probe ids
  (`max_tokens` greedy tokens, `prompt_logprobs`) one after the other for the whole run; each
  request records when it was sent and answered, its prompt logprobs of the probe ids and
  its completion tokens.
- `generated_tokens(url)`: vLLM's own `vllm:generation_tokens_total` (`/metrics`): read
  before the transfer starts and once every trainer rank's writes are done, the difference
  is the tokens the engine generated while the transfer ran.
- `sort_requests`: a request answered before the pause took effect must see version N (its
  probe logprobs equal N's), one sent after it (the engine queues it until resume, after the
  switch) must see N+1, one in between either; none may match neither (a mix of the two).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    sent: float
    done: float
    logprobs: torch.Tensor
    tokens: int


def post(url: str, path: str, body: dict | None = None, timeout: float = 300) -> object:
    req = urllib.request.Request(f"{url}/{path}", data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = r.read()
    return json.loads(data) if data else None


def probe_logprobs(choice: dict, ids: list[int]) -> torch.Tensor:
    """The engine's prompt logprob of each probe id after the first."""
    return torch.tensor([d[str(ids[i])]["logprob"]
                         for i, d in enumerate(choice["prompt_logprobs"][1:], start=1)],
                        dtype=torch.float32)


@dataclass
class Client:
    url: str
    model: str
    probe: list[int]
    threads: int = 2
    max_tokens: int = 8
    requests: list[Request] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, daemon=True, name=f"client {i}")
                         for i in range(self.threads)]

    def start(self) -> Client:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)

    def _loop(self) -> None:
        body = {"model": self.model, "prompt": self.probe, "max_tokens": self.max_tokens,
                "temperature": 0, "prompt_logprobs": 0, "ignore_eos": True}
        while not self._stop.is_set():
            sent = time.perf_counter()
            try:
                out = post(self.url, "v1/completions", body)
            except OSError as e:  # counted: a refit must not fail the engine's requests
                with self._lock:
                    self.errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.2)
                continue
            done = time.perf_counter()
            assert isinstance(out, dict)
            req = Request(sent, done, probe_logprobs(out["choices"][0], self.probe),
                          int(out["usage"]["completion_tokens"]))
            with self._lock:
                self.requests.append(req)

    def between(self, t0: float, t1: float) -> list[Request]:
        """The requests answered after `t0` and sent before `t1` (train.py: from the step's
        start to its checks after resume, before the next refit)."""
        with self._lock:
            return [r for r in self.requests if r.done > t0 and r.sent < t1]


def generated_tokens(url: str) -> float:
    """vLLM's `vllm:generation_tokens_total`, summed over its label sets."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


@dataclass
class Sorted:
    old: int = 0
    """Answered before the pause took effect: saw version N."""
    new: int = 0
    """Sent after the pause took effect: saw N+1 (N when the update was torn)."""
    either: int = 0
    """Sent before, answered after the pause took effect: N or N+1."""
    wrong: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"requests N {self.old}, N+1 {self.new}, either {self.either}, wrong "
                f"{len(self.wrong)}")


def distance(a: torch.Tensor | None, b: torch.Tensor) -> float:
    return float("inf") if a is None else (a - b).abs().max().item()


def sort_requests(requests: list[Request], paused: float, old: torch.Tensor,
                  new: torch.Tensor | None, tolerance: float) -> Sorted:
    """`paused`: when the pause call returned (new requests queued from then on); `old`:
    version N's probe logprobs, `new`: N+1's (None: the update was torn, N must stay)."""
    out = Sorted()
    for r in requests:
        is_old = distance(old, r.logprobs) <= tolerance
        is_new = new is not None and distance(new, r.logprobs) <= tolerance
        if r.done < paused:
            out.old += 1
            ok, want = is_old, "N"
        elif r.sent > paused:
            out.new += 1
            ok, want = (is_new, "N+1") if new is not None else (is_old, "N (torn)")
        else:
            out.either += 1
            ok, want = is_old or is_new, "N or N+1"
        if not ok:
            out.wrong.append(f"a request sent at {r.sent:.3f} s, answered at {r.done:.3f} s "
                             f"should see {want}: |delta| to N {distance(old, r.logprobs):.2e}"
                             f", to N+1 {distance(new, r.logprobs):.2e}")
    return out
