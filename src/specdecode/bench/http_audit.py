"""The losslessness audit of any OpenAI-compatible server (`specdecode audit --endpoint URL
--reference URL`): a speculative deployment against a plain one of the same model.

- **Greedy** (temperature 0, the default): every prompt of the workload (its first turn, as one
  user message; or raw text with `chat=False`) goes to both servers; the replies must be
  token-identical, request by request. Token ids are compared where both servers return them
  (vLLM does with `return_token_ids`; the probe asks each server once), else the texts. Where
  they differ, the report gives the first differing position (in tokens, or characters) and
  both texts. At concurrency C > 1 the endpoint and the reference each get C requests in flight,
  and the reference is also run one request at a time: if the reference's own replies change
  with the concurrency, the server's batched kernels are not batch-invariant, and a difference
  between the two servers at that concurrency cannot be blamed on speculation alone (the report
  says so, with the count).
- **Sampled** (temperature > 0): `samples` requests of `tokens` tokens to each server for the
  first prompt, with seeds 2i (reference) and 2i + 1 (endpoint): independent samples, compared
  as two categorical samples over whole token sequences by the same two-sample chi-square test
  and TV bound as the in-process audit (audit.grouped, audit_stats), failing below the stated
  false-alarm rate.
- A request that fails (an HTTP error, a timeout, a malformed reply) is reported for that
  request and counted; it never counts as identical, and the verdict is then INCOMPLETE (exit
  1). Every reply is appended to `--out` (JSON lines) as it arrives, so nothing measured is lost
  if the run is interrupted.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from specdecode.audit import AuditResult, Outcome, detectable_tv, grouped
from specdecode.audit_stats import chi_square_homogeneity, tv_two_sample
from specdecode.bench.http_runner import Endpoint, error_message
from specdecode.bench.workloads import Prompt
from specdecode.errors import SpecDecodeError

SHOWN_CHARS = 240  # of each text, around the first difference, in the rendered report


@dataclass(frozen=True)
class Reply:
    text: str
    token_ids: tuple[int, ...] | None  # None: the server returned none
    finish_reason: str | None
    error: str | None = None


@dataclass(frozen=True)
class Target:
    """A server as the audit talks to it: its model id and whether it returns token ids."""

    endpoint: Endpoint
    model: str
    token_ids: bool


@dataclass(frozen=True)
class Comparison:
    """One prompt's greedy replies: identical, or where they first differ."""

    prompt_id: str
    category: str
    identical: bool | None  # None: a request failed
    position: int | None = None  # first differing token (or character) index
    unit: str = "token"  # "token" or "character"
    endpoint_text: str = ""
    reference_text: str = ""
    error: str | None = None


@dataclass
class EndpointAudit:
    """What `audit --endpoint` found."""

    endpoint: str
    reference: str
    concurrency: int
    mode: str  # "greedy" or "sampled"
    comparisons: list[Comparison] = field(default_factory=list)
    # greedy at concurrency > 1: the reference's replies at this concurrency vs one at a time
    reference_self: list[Comparison] | None = None
    sampled: AuditResult | None = None
    errors: int = 0

    @property
    def verdict(self) -> str:
        if self.errors:
            return "INCOMPLETE"
        if self.mode == "sampled":
            return "PASS" if self.sampled is not None and self.sampled.passed else "FAIL"
        return "PASS" if all(c.identical for c in self.comparisons) else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["verdict"] = self.verdict
        return out

    def render(self) -> str:
        head = (f"audit --endpoint {self.endpoint} against --reference {self.reference}, "
                f"concurrency {self.concurrency}")
        lines = [head]
        if self.mode == "sampled" and self.sampled is not None:
            lines.append(self.sampled.render().replace("speculative", "endpoint")
                         .replace("plain", "reference"))
        elif self.mode == "greedy":
            same = sum(1 for c in self.comparisons if c.identical)
            failed = sum(1 for c in self.comparisons if c.identical is None)
            unit = self.comparisons[0].unit if self.comparisons else "token"
            lines.append(f"greedy: {same}/{len(self.comparisons)} requests {unit}-identical to "
                         f"the reference" + (f", {failed} failed" if failed else ""))
            for c in self.comparisons:
                if c.identical is None:
                    lines.append(f"  {c.prompt_id} ({c.category}): request failed: {c.error}")
                elif not c.identical:
                    lines.append(f"  {c.prompt_id} ({c.category}): first difference at "
                                 f"{c.unit} {c.position}")
                    lines.append(f"    endpoint:  {_excerpt(c.endpoint_text, c, self)}")
                    lines.append(f"    reference: {_excerpt(c.reference_text, c, self)}")
            if self.reference_self is not None:
                same_ref = sum(1 for c in self.reference_self if c.identical)
                lines.append(
                    f"the reference's own replies at concurrency {self.concurrency} vs one "
                    f"request at a time: {same_ref}/{len(self.reference_self)} identical"
                    + ("" if same_ref == len(self.reference_self) else
                       " (its batched kernels are not batch-invariant: differences between the"
                       " two servers at this concurrency are not speculation's alone)"))
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def _excerpt(text: str, c: Comparison, audit: EndpointAudit) -> str:
    """The text around the first difference (characters: exact; tokens: from the start)."""
    start = max(0, (c.position or 0) - 40) if c.unit == "character" else 0
    piece = text[start : start + SHOWN_CHARS]
    return json.dumps(("..." if start else "") + piece, ensure_ascii=False)


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first element where a and b differ (the shorter's length when one is a
    prefix of the other), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(prompt: Prompt, endpoint: Reply, reference: Reply) -> Comparison:
    """One prompt's two greedy replies (token ids where both have them, else texts)."""
    error = endpoint.error or reference.error
    if error is not None:
        which = "endpoint" if endpoint.error else "reference"
        return Comparison(prompt.id, prompt.category, None, error=f"{which}: {error}")
    if endpoint.token_ids is not None and reference.token_ids is not None:
        position, unit = first_difference(endpoint.token_ids, reference.token_ids), "token"
    else:
        position, unit = first_difference(endpoint.text, reference.text), "character"
    return Comparison(prompt.id, prompt.category, position is None, position, unit,
                      endpoint.text, reference.text)


# ------------------------------------------------------------------------------- HTTP


class Client:
    """Requests to the two servers (one event loop, one connection pool)."""

    def __init__(self, api_key: str | None = None, timeout: float = 300.0, chat: bool = True,
                 log: TextIO | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.chat = chat
        self.log = log
        self._loop = asyncio.new_event_loop()
        self._client = httpx.AsyncClient(headers=headers,
                                         timeout=httpx.Timeout(timeout, connect=10.0),
                                         limits=httpx.Limits(max_connections=None))

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.aclose())
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def target(self, endpoint: Endpoint, model: str | None) -> Target:
        """Probe a server: its model (the one asked for, else the first listed), one short
        request, and whether it returns token ids. SpecDecodeError naming the URL if unusable."""
        url = f"{endpoint.api}/models"
        try:
            response = self._loop.run_until_complete(self._client.get(url))
        except httpx.HTTPError as exc:
            raise SpecDecodeError(f"cannot reach {url}: {exc or type(exc).__name__}") from None
        try:
            ids = [str(m["id"]) for m in response.json()["data"]] \
                if response.status_code == 200 else None
        except (ValueError, KeyError, TypeError):
            ids = None
        if ids is None:
            raise SpecDecodeError(f"{url} answered HTTP {response.status_code} without an "
                                  "OpenAI model list: is this an OpenAI-compatible server?")
        if model is not None and ids and model not in ids:
            raise SpecDecodeError(f"{url} does not list the model {model!r} (it lists: "
                                  f"{', '.join(ids[:10])})")
        if model is None and not ids:
            raise SpecDecodeError(f"{url} lists no model")
        chosen = model or ids[0]
        probe = Prompt("probe", "probe", ["Say hi."], max_tokens=2)
        for ask_ids in (True, False):
            reply = self._loop.run_until_complete(
                self._request(Target(endpoint, chosen, ask_ids), probe, 0.0, None))
            if reply.error is None:
                return Target(endpoint, chosen, ask_ids and reply.token_ids is not None)
        raise SpecDecodeError(f"test request to {endpoint.api} failed: {reply.error}")

    def body(self, target: Target, prompt: Prompt, temperature: float, seed: int | None
             ) -> dict[str, Any]:
        body: dict[str, Any] = {"model": target.model, "temperature": temperature,
                                "max_tokens": prompt.max_tokens or 128}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt.turns[0]}]
        else:
            body["prompt"] = prompt.turns[0]
        if seed is not None:
            body["seed"] = seed
        if target.token_ids:
            body["return_token_ids"] = True
        return body

    async def _request(self, target: Target, prompt: Prompt, temperature: float,
                       seed: int | None) -> Reply:
        path = "chat/completions" if self.chat else "completions"
        try:
            response = await self._client.post(f"{target.endpoint.api}/{path}",
                                               json=self.body(target, prompt, temperature, seed))
        except httpx.HTTPError as exc:
            return Reply("", None, None, f"{type(exc).__name__}: {exc}".rstrip(": "))
        if response.status_code != 200:
            return Reply("", None, None, f"HTTP {response.status_code}: "
                                         f"{error_message(response.content)}")
        try:
            choice = response.json()["choices"][0]
            text = choice["message"]["content"] if self.chat else choice["text"]
            ids = choice.get("token_ids")
            return Reply(str(text or ""), tuple(int(t) for t in ids) if ids else None,
                         choice.get("finish_reason"))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return Reply("", None, None, f"malformed reply ({type(exc).__name__}: {exc})")

    def run(self, target: Target, prompts: Sequence[Prompt], concurrency: int,
            temperature: float = 0.0, seeds: Sequence[int | None] | None = None,
            label: str = "") -> list[Reply]:
        """Every prompt's reply, at most `concurrency` requests in flight (a new one starts as
        one ends), each logged to `log` as it arrives."""
        seeds = seeds if seeds is not None else [None] * len(prompts)

        async def all_of() -> list[Reply]:
            gate = asyncio.Semaphore(concurrency)

            async def one(prompt: Prompt, seed: int | None) -> Reply:
                async with gate:
                    reply = await self._request(target, prompt, temperature, seed)
                if self.log is not None:
                    self.log.write(json.dumps({"run": label, "prompt": prompt.id,
                                               "seed": seed, **asdict(reply)}) + "\n")
                    self.log.flush()
                return reply

            return list(await asyncio.gather(*(one(p, s) for p, s in
                                               zip(prompts, seeds, strict=True))))

        return self._loop.run_until_complete(all_of())


# ------------------------------------------------------------------------------- the audit


def audit_greedy(client: Client, endpoint: Target, reference: Target, prompts: Sequence[Prompt],
                 concurrency: int) -> EndpointAudit:
    """Greedy identity request by request (see the module docstring)."""
    ids = endpoint.token_ids and reference.token_ids
    if not ids:
        endpoint = Target(endpoint.endpoint, endpoint.model, False)
        reference = Target(reference.endpoint, reference.model, False)
    ref = client.run(reference, prompts, 1, label="reference c1")
    out = client.run(endpoint, prompts, concurrency, label=f"endpoint c{concurrency}")
    audit = EndpointAudit(endpoint.endpoint.url, reference.endpoint.url, concurrency, "greedy")
    audit.comparisons = [compare(p, o, r) for p, o, r in zip(prompts, out, ref, strict=True)]
    if concurrency > 1:
        ref_c = client.run(reference, prompts, concurrency, label=f"reference c{concurrency}")
        audit.reference_self = [compare(p, o, r) for p, o, r in
                                zip(prompts, ref_c, ref, strict=True)]
    audit.errors = sum(1 for c in [*audit.comparisons, *(audit.reference_self or [])]
                       if c.identical is None)
    return audit


def audit_sampled(client: Client, endpoint: Target, reference: Target, prompt: Prompt,
                  concurrency: int, temperature: float, samples: int, tokens: int,
                  false_alarm: float, cells: int = 30) -> EndpointAudit:
    """Two independent samples of the first `tokens` tokens, compared (module docstring)."""
    if tokens < 2:
        raise SpecDecodeError(f"--tokens {tokens}: the sampled audit needs at least 2 tokens "
                              "per outcome (a server's first token is the target's alone)")
    short = Prompt(prompt.id, prompt.category, prompt.turns[:1], max_tokens=tokens)
    batch = [short] * samples
    ref = client.run(reference, batch, concurrency, temperature,
                     [2 * i for i in range(samples)], "reference sampled")
    out = client.run(endpoint, batch, concurrency, temperature,
                     [2 * i + 1 for i in range(samples)], "endpoint sampled")
    audit = EndpointAudit(endpoint.endpoint.url, reference.endpoint.url, concurrency, "sampled")
    audit.errors = sum(1 for r in [*ref, *out] if r.error is not None)
    a: Counter[Outcome] = Counter(outcome(r, tokens) for r in ref if r.error is None)
    b: Counter[Outcome] = Counter(outcome(r, tokens) for r in out if r.error is None)
    if not a or not b:
        return audit
    ca, cb = grouped(a, b, cells)
    test = chi_square_homogeneity(ca, cb)
    tv = tv_two_sample(ca, cb, delta=0.05)
    n = min(sum(a.values()), sum(b.values()))
    audit.sampled = AuditResult("sampled", test.p_value >= false_alarm, n, tokens, false_alarm,
                                test.p_value, tv.estimate, tv.upper_bound, tv.confidence,
                                len(ca), detectable_tv=detectable_tv(n, false_alarm, len(ca)))
    return audit


def outcome(reply: Reply, tokens: int) -> Outcome:
    """A sampled reply as an outcome: its first `tokens` token ids, else a hash-free stand-in
    for its text (its characters' code points: distinct texts, distinct outcomes)."""
    if reply.token_ids is not None:
        return tuple(reply.token_ids[:tokens])
    return tuple(ord(ch) for ch in reply.text)


def write_report(audits: Sequence[EndpointAudit], path: Path) -> None:
    path.write_text(json.dumps([a.to_dict() for a in audits], indent=1) + "\n", encoding="utf-8")
