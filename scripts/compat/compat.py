"""deepmesh against the clients people benchmark and evaluate servers with (`make compat`).

Installs the pinned clients (requirements.txt) into .compat-venv, starts `deepmesh serve` with
the tiny model on a free port, runs each client briefly and checks the client's own report: no
errored request, non-empty answers, as many output tokens as asked. One line per client; the
exit code is non-zero when any failed. For a failed client, the request body it was captured
sending (tests/fixtures/clients/) is sent to the server again, to show the server's own answer.

    scripts/compat/run                   # every client against deepmesh serve
    scripts/compat/run --only guidellm   # the cases whose names start with guidellm
    scripts/compat/run --record          # against record.py instead: writes the fixtures anew
    scripts/compat/run --url http://127.0.0.1:8000   # against a server already running

Standard library only: it runs before the clients' environment exists, under any Python 3.11+.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "scripts" / "compat"
VENV = ROOT / ".compat-venv"
REQUIREMENTS = HERE / "requirements.txt"
STAMP = VENV / ".requirements.sha256"
DEEPMESH = ROOT / ".venv" / "bin" / "deepmesh"
MODEL_DIR = ROOT / ".cache" / "models" / "tiny"
MODEL = "deepmesh-tiny"  # deepmesh serve's default --served-model-name
FIXTURES = ROOT / "tests" / "fixtures" / "clients"
TASKS = HERE / "lm_eval_tasks"

PROMPT_TOKENS = 32
OUTPUT_TOKENS = 8
GUIDELLM_REQUESTS = 4
AIPERF_REQUESTS = 8
LM_EVAL_LIMIT = 4  # documents per task; the multiple-choice task sends one request per choice
LM_EVAL_GEN_TOKENS = 8  # max_gen_toks in lm_eval_tasks/deepmesh_compat_gen.yaml
# seconds for one client, at least five times what each takes on two CPU cores: a server that
# ignores the output length asked for generates up to its context limit, and the client waits
CLIENT_TIMEOUT = 300
REPLAY_TIMEOUT = 60
DROPPED_HEADERS = {"host", "content-length", "connection", "accept-encoding"}  # the connection's, not the client's


def rel(path: Path) -> str:
    """Paths relative to the repository root: the commands run there, and read well in fixtures."""
    return os.path.relpath(path, ROOT)


def command(line: str) -> list[str]:
    """argv of a command written as it would be typed (with paths quoted by q)."""
    return shlex.split(line)


def q(path: Path | str) -> str:
    return shlex.quote(str(path))


@dataclass
class Outcome:
    """What one client run came to, read from the client's own report files."""

    ok: int = 0
    errors: int = 0
    tokens: list[float] = field(default_factory=list)  # output tokens of each answered request
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.ok > 0 and not self.errors and not self.problems

    def expect_tokens(self, wanted: int) -> None:
        if wrong := [tokens for tokens in self.tokens if tokens != wanted]:
            self.problems.append(f"output tokens {wrong}, asked {wanted}")


@dataclass
class Fixture:
    """tests/fixtures/clients/<name>.json: the requests a case sends to one endpoint."""

    name: str
    path: str
    match: Callable[[dict[str, Any]], bool] = lambda body: True


@dataclass
class Case:
    name: str
    client: str  # its package in requirements.txt
    argv: Callable[[str, Path], list[str]]  # (server base URL, output directory) -> command
    check: Callable[[Path], Outcome]  # output directory -> outcome
    fixtures: list[Fixture]
    offline: bool = True  # HF_HUB_OFFLINE and friends: nothing is needed from the hub


# --- guidellm ----------------------------------------------------------------------------------


def guidellm_argv(path: str) -> Callable[[str, Path], list[str]]:
    def argv(base: str, out: Path) -> list[str]:
        # no model named: guidellm takes the first of GET /v1/models, as for a user who names none;
        # that name is no hub model, so the prompts are measured with the checkpoint's tokenizer
        return command(
            f"{q(VENV / 'bin' / 'guidellm')} run"
            f" --backend kind=openai_http,target={base},request_format={path}"
            f" --profile kind=synchronous --constraint kind=max_requests,count={GUIDELLM_REQUESTS}"
            f" --data kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}"
            f" --tokenizer kind=huggingface_auto,model={q(rel(MODEL_DIR))}"
            f" --output kind=json,path={q(rel(out / 'benchmarks.json'))} --disable-console-interactive"
        )

    return argv


def check_guidellm(out: Path) -> Outcome:
    outcome = Outcome()
    if (report := read_json(out / "benchmarks.json", outcome)) is None:
        return outcome
    if not report.get("benchmarks"):
        outcome.problems.append("the report has no benchmark")
        return outcome
    benchmark = report["benchmarks"][0]
    totals = benchmark["metrics"]["request_totals"]
    outcome.ok, outcome.errors = totals["successful"], totals["errored"] + totals["incomplete"]
    for request in benchmark["requests"].get("errored") or []:
        outcome.problems.append(f"errored: {request['info'].get('error')}")
    for request in benchmark["requests"].get("successful") or []:
        outcome.tokens.append(request["output_metrics"].get("text_tokens") or 0)  # the server's usage
        if not request.get("output"):
            outcome.problems.append(f"an empty answer to {request['request_id']}")
    if outcome.ok != GUIDELLM_REQUESTS:
        outcome.problems.append(f"{outcome.ok} requests answered of {GUIDELLM_REQUESTS}")
    outcome.expect_tokens(OUTPUT_TOKENS)
    return outcome


# --- aiperf ------------------------------------------------------------------------------------


def aiperf_argv(base: str, out: Path) -> list[str]:
    # --extra-inputs ignore_eos:true: how aiperf's docs ask for a fixed output length;
    # --random-seed: the same prompts every run, so that the fixtures stay put
    return command(
        f"{q(VENV / 'bin' / 'aiperf')} profile --model {MODEL} --url {base} --endpoint-type chat"
        f" --tokenizer {q(rel(MODEL_DIR))}"
        f" --synthetic-input-tokens-mean {PROMPT_TOKENS} --synthetic-input-tokens-stddev 0"
        f" --output-tokens-mean {OUTPUT_TOKENS} --output-tokens-stddev 0 --extra-inputs ignore_eos:true"
        f" --request-count {AIPERF_REQUESTS} --concurrency 1 --random-seed 0"
        f" --artifact-dir {q(rel(out))} --ui-type none"
    )


def check_aiperf(out: Path) -> Outcome:
    outcome = Outcome()
    if (summary := read_json(out / "profile_export_aiperf.json", outcome)) is None:
        return outcome
    outcome.errors = int((summary.get("error_request_count") or {}).get("avg") or 0)
    for error in summary.get("error_summary") or []:
        details = error["error_details"]
        outcome.problems.append(f"{error['count']} x {details.get('code')}: {details.get('message')}")
    records = out / "profile_export.jsonl"
    for line in records.read_text().splitlines() if records.is_file() else []:
        record = json.loads(line)
        if record.get("error"):
            continue  # in error_request_count
        metrics = record["metrics"]
        outcome.ok += 1
        answer_tokens = (metrics.get("output_sequence_length") or {}).get("value")  # aiperf's count of the text
        if not answer_tokens:
            outcome.problems.append("an empty answer")
        # the server's usage, where it sent one: aiperf counts the text again with the tokenizer
        outcome.tokens.append((metrics.get("usage_completion_tokens") or {}).get("value") or answer_tokens or 0)
    if outcome.ok != AIPERF_REQUESTS:
        outcome.problems.append(f"{outcome.ok} requests answered of {AIPERF_REQUESTS}")
    outcome.expect_tokens(OUTPUT_TOKENS)
    return outcome


# --- lm-eval -----------------------------------------------------------------------------------


def lm_eval_argv(model: str, path: str, tasks: str, *model_args: str) -> Callable[[str, Path], list[str]]:
    def argv(base: str, out: Path) -> list[str]:
        # a chat model takes messages, which lm-eval builds with --apply_chat_template only
        chat = " --apply_chat_template" if model.endswith("chat-completions") else ""
        return command(
            f"{q(VENV / 'bin' / 'lm-eval')} run --model {model}"
            f" --model_args {q(','.join([f'model={MODEL}', f'base_url={base}{path}', *model_args]))}"
            f" --include_path {q(rel(TASKS))} --tasks {tasks} --limit {LM_EVAL_LIMIT}"
            f" --output_path {q(rel(out))} --log_samples{chat}"
        )

    return argv


def check_lm_eval(out: Path) -> Outcome:
    outcome = Outcome()
    if not (results := sorted(out.rglob("results_*.json"))):
        outcome.problems.append(f"no results_*.json in {rel(out)}")
        return outcome
    answers: list[str] = []
    for task, counts in json.loads(results[-1].read_text())["n-samples"].items():
        samples = [json.loads(line) for path in out.rglob(f"samples_{task}_*.jsonl") for line in path.open()]
        if len(samples) != counts["effective"]:
            outcome.problems.append(f"{task}: {len(samples)} samples of {counts['effective']}")
        for response in (response[0] for sample in samples for response in sample["resps"]):
            if isinstance(response, str):  # generate_until: the answer
                answers.append(response)
            elif not is_logprob(response[0]):  # loglikelihood: (log-probability, is greedy), as strings
                outcome.errors += 1
                outcome.problems.append(f"{task}: not a log-probability: {response!r}")
                continue
            outcome.ok += 1
    if empty := sum(not answer.strip() for answer in answers):
        outcome.problems.append(f"{empty} empty answers of {len(answers)}")
    # lm-eval keeps the answers' text alone; its tokens, counted again, can only be bounded: a stop
    # string may end an answer early, and decoded text need not encode back to as many tokens
    outcome.tokens = count_tokens(answers)
    if any(tokens > LM_EVAL_GEN_TOKENS for tokens in outcome.tokens):
        outcome.problems.append(f"answers of {outcome.tokens} tokens, max_gen_toks {LM_EVAL_GEN_TOKENS}")
    return outcome


def is_logprob(value: str) -> bool:
    try:
        return math.isfinite(number := float(value)) and number <= 0
    except ValueError:
        return False


def count_tokens(texts: list[str]) -> list[float]:
    """Tokens of each text by the checkpoint's tokenizer, with `tokenizers` from the clients' venv."""
    if not texts:
        return []
    script = (
        "import json, sys; from tokenizers import Tokenizer; t = Tokenizer.from_file(sys.argv[1]); "
        "print(json.dumps([len(t.encode(s, add_special_tokens=False).ids) for s in json.load(sys.stdin)]))"
    )
    argv = [str(VENV / "bin" / "python"), "-c", script, str(MODEL_DIR / "tokenizer.json")]
    return json.loads(subprocess.run(argv, input=json.dumps(texts), capture_output=True, text=True).stdout)


CASES = [
    Case(
        "guidellm-chat",
        "guidellm",
        guidellm_argv("/v1/chat/completions"),
        check_guidellm,
        [Fixture("guidellm-chat-completions", "/v1/chat/completions")],
    ),
    Case(
        "guidellm-text",
        "guidellm",
        guidellm_argv("/v1/completions"),
        check_guidellm,
        [Fixture("guidellm-completions", "/v1/completions")],
    ),
    Case(
        "aiperf-chat",
        "aiperf",
        aiperf_argv,
        check_aiperf,
        [Fixture("aiperf-chat-completions", "/v1/chat/completions")],
        # aiperf 0.13.0 offline looks every tokenizer up in the hub's cache, a local directory too
        # (HFValidationError); online, it loads a local directory without asking the hub
        offline=False,
    ),
    Case(
        "lm-eval-completions",
        "lm-eval",
        # the checkpoint's tokenizer measures the contexts of the loglikelihood requests (the served
        # name is no hub model); tokenizer_backend named, lm-eval does not first probe the server
        # for vLLM's /tokenizer_info and /tokenize
        lm_eval_argv(
            "local-completions",
            "/v1/completions",
            "deepmesh_compat_gen,deepmesh_compat_mc",
            "tokenizer_backend=huggingface",
            f"tokenizer={rel(MODEL_DIR)}",
        ),
        check_lm_eval,
        [
            Fixture("lm-eval-completions-generate_until", "/v1/completions", lambda body: not body.get("echo")),
            Fixture("lm-eval-completions-loglikelihood", "/v1/completions", lambda body: bool(body.get("echo"))),
        ],
    ),
    Case(
        "lm-eval-chat",
        "lm-eval",
        # no tokenizer on the client side: the server applies its chat template
        lm_eval_argv("local-chat-completions", "/v1/chat/completions", "deepmesh_compat_gen"),
        check_lm_eval,
        [Fixture("lm-eval-chat-completions", "/v1/chat/completions")],
    ),
]


# --- helpers -----------------------------------------------------------------------------------


def read_json(path: Path, outcome: Outcome) -> Any:
    if not path.is_file():
        outcome.problems.append(f"no report {rel(path)}")
        return None
    return json.loads(path.read_text())


def versions() -> dict[str, str]:
    """The pins of requirements.txt: {package: version}."""
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        if "==" in (spec := line.split("#")[0].strip()):
            name, version = spec.split("==")
            pins[name.split("[")[0]] = version
    return pins


def tail(path: Path, lines: int = 5) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
    return "\n".join(f"    {line[:300]}" for line in text[-lines:])


def start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A process in a group of its own, so that stop() reaches whatever it starts in turn."""
    with log.open("wb") as output:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=output, stderr=output, start_new_session=True)


def stop(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the process group, then SIGKILL to what is left of it: nothing keeps running."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


# --- the clients' environment ------------------------------------------------------------------


def ensure_venv() -> float:
    """Installs the pinned clients unless the stamp says these very requirements are in; seconds."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if STAMP.is_file() and STAMP.read_text().strip() == digest:
        return 0.0
    started = time.monotonic()
    print(f"installing {', '.join(f'{k}=={v}' for k, v in versions().items())} into {rel(VENV)}", flush=True)
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    # uv (the project's, or one on PATH) links the wheels it has cached, torch's among them
    uv = ROOT / ".venv" / "bin" / "uv"
    if uv_path := str(uv) if uv.exists() else shutil.which("uv"):
        install = [uv_path, "pip", "install", "--quiet", "--python", str(VENV / "bin" / "python")]
    else:
        install = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*install, "-r", str(REQUIREMENTS)], check=True)
    STAMP.write_text(digest + "\n")
    return time.monotonic() - started


def client_env(work: Path, offline: bool) -> dict[str, str]:
    drop = {"PYTHONPATH", "PYTHONHOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env |= {
        "VIRTUAL_ENV": str(VENV),
        "PATH": f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": str(work / "hf"),  # the datasets cache of the local task files, thrown away with work/
        "TOKENIZERS_PARALLELISM": "false",
    }
    if offline:  # an attempt to reach the hub fails at once instead of waiting out a network timeout
        env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return env


# --- the server --------------------------------------------------------------------------------


@contextlib.contextmanager
def server(work: Path, record: bool) -> Iterator[str]:
    """deepmesh serve (or record.py) on a free port for the length of the block; its base URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if record:
        argv = [sys.executable, str(HERE / "record.py"), "--port", str(port), "--log", str(work / "requests.jsonl")]
        env = dict(os.environ)
    else:
        if not (MODEL_DIR / "config.json").is_file():
            subprocess.run([str(DEEPMESH), "make-model", rel(MODEL_DIR), "--preset", "tiny", "--seed", "0"], check=True)
        # --no-compile: the decode graphs would take both cores for minutes, and the clients check
        # the protocol, not the speed
        argv = [str(DEEPMESH), "serve", "--model", rel(MODEL_DIR), "--host", "127.0.0.1", "--port", str(port)]
        argv.append("--no-compile")
        # a database, KV cache, files and traces of its own: nothing shared with another server here
        env = dict(os.environ) | {
            "DEEPMESH_DATABASE_URL": f"sqlite:///{work / 'deepmesh.db'}",
            "DEEPMESH_CACHE_DIR": str(work / "kv"),
            "DEEPMESH_CLAIM_DIR": str(work / "claims"),
            "DEEPMESH_FILES_DIR": str(work / "files"),
            "DEEPMESH_TRACE_FILE": str(work / "traces.jsonl"),
        }
    process = start(argv, work / "server.log", env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, process, work / "server.log")
        yield base
    finally:
        stop(process, grace=15)


def wait_healthy(base: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}) before it was healthy:\n{tail(log, 20)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{base}/healthz", timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"the server was not healthy within {timeout:.0f} s:\n{tail(log, 20)}")


# --- fixtures ----------------------------------------------------------------------------------


def write_fixtures(case: Case, entries: list[dict[str, Any]], argv: list[str]) -> None:
    """The first two requests to each fixture's endpoint, and the other requests the client made."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    paths = {fixture.path for fixture in case.fixtures}
    others = sorted({f"{e['method']} {e['path']}" for e in entries if e["path"].split("?")[0] not in paths})
    for fixture in case.fixtures:
        sent = [e for e in entries if e["path"].split("?")[0] == fixture.path and fixture.match(e["body"])]
        document = {
            "client": f"{case.client} {versions()[case.client]}",
            "command": shlex.join(argv),
            "other_requests": others,
            "requests": [
                {
                    "method": e["method"],
                    "path": e["path"],
                    "headers": {k: v for k, v in e["headers"].items() if k.lower() not in DROPPED_HEADERS},
                    "body": e["body"],
                }
                for e in sent[:2]
            ],
        }
        (FIXTURES / f"{fixture.name}.json").write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")


def replay(case: Case, base: str) -> list[str]:
    """The server's answer to the first captured body of each of the case's fixtures."""
    lines = []
    for fixture in case.fixtures:
        path = FIXTURES / f"{fixture.name}.json"
        if not path.is_file() or not (requests := json.loads(path.read_text())["requests"]):
            continue
        sent = requests[0]
        request = urllib.request.Request(base + sent["path"], json.dumps(sent["body"]).encode(), sent["headers"])
        try:
            with urllib.request.urlopen(request, timeout=REPLAY_TIMEOUT) as response:
                answer = f"{response.status} {response.read(300).decode(errors='replace')}"
        except urllib.error.HTTPError as error:
            answer = f"{error.code} {error.read(600).decode(errors='replace')}"
        except OSError as error:
            answer = f"no answer: {error}"
        lines.append(f"    the server answers the body in {rel(path)}: {' '.join(answer.split())}")
    return lines


# --- the run -----------------------------------------------------------------------------------


def run_case(case: Case, base: str, work: Path, record: bool) -> tuple[Outcome, float]:
    out = work / case.name
    out.mkdir(parents=True)
    argv = case.argv(base, out)
    requests_log = work / "requests.jsonl"  # record.py's
    seen = len(requests_log.read_text().splitlines()) if requests_log.is_file() else 0
    print(f"$ {shlex.join(argv)}", flush=True)
    started = time.monotonic()
    process = start(argv, work / f"{case.name}.log", client_env(work, case.offline))
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=CLIENT_TIMEOUT)
        timed_out = process.poll() is None
    finally:  # on Ctrl-C and SIGTERM too
        stop(process, grace=10)  # and whatever workers it left behind
    seconds = time.monotonic() - started
    try:
        outcome = case.check(out)
    except (KeyError, TypeError, ValueError) as error:  # a report of another shape than expected
        outcome = Outcome(problems=[f"unreadable report: {error!r}"])
    if timed_out:
        outcome.problems.insert(0, f"timed out after {CLIENT_TIMEOUT} s")
    elif process.returncode:
        outcome.problems.insert(0, f"exited {process.returncode}")
    if record:
        entries = [json.loads(line) for line in requests_log.read_text().splitlines()[seen:]]
        # the port of the day and this checkout's path are noise in a fixture
        generic = [part.replace(base, "http://127.0.0.1:8000").replace(f"{ROOT}/", "") for part in argv]
        write_fixtures(case, entries, generic)
    return outcome, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated prefixes of case names (default: every case)")
    parser.add_argument("--record", action="store_true", help="run against record.py and write the fixtures anew")
    parser.add_argument("--url", help="a server already running (http://HOST:PORT) instead of deepmesh serve")
    args = parser.parse_args()
    prefixes = tuple(prefix for prefix in args.only.split(",") if prefix)
    if not (cases := [case for case in CASES if not prefixes or case.name.startswith(prefixes)]):
        parser.error(f"no case matches {args.only!r}: {', '.join(case.name for case in CASES)}")
    # SIGTERM unwinds like Ctrl-C does, through the finally blocks that stop the server and clients
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    install = ensure_venv()
    work = ROOT / ".cache" / "compat" / ("record" if args.record else "serve")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results: list[tuple[Case, Outcome, float]] = []
    started = time.monotonic()
    if args.url and args.record:
        parser.error("--url and --record: the fixtures come from record.py alone")
    with contextlib.nullcontext(args.url.rstrip("/")) if args.url else server(work, args.record) as base:
        for case in cases:
            outcome, seconds = run_case(case, base, work, args.record)
            results.append((case, outcome, seconds))
            if not outcome.passed:
                log = work / f"{case.name}.log"
                print(f"  {case.name} failed; the end of {rel(log)}:\n{tail(log)}")
                if not args.record:
                    print("\n".join(replay(case, base)), flush=True)
    print(f"\n{'client':<22}{'result':<8}{'answered':>10}{'errors':>8}{'mean out tokens':>17}{'seconds':>9}")
    for case, outcome, seconds in results:
        mean = f"{sum(outcome.tokens) / len(outcome.tokens):.1f}" if outcome.tokens else "-"
        verdict = "ok" if outcome.passed else "FAIL"
        print(f"{case.name:<22}{verdict:<8}{outcome.ok:>10}{outcome.errors:>8}{mean:>17}{seconds:>9.0f}")
        for problem in outcome.problems[:3]:
            print(f"    {' '.join(problem.split())[:400]}")
    pins = ", ".join(f"{name} {version}" for name, version in versions().items())
    print(f"\n{pins}; install {install:.0f} s, clients {time.monotonic() - started:.0f} s; reports in {rel(work)}")
    if args.record:
        print(f"fixtures written to {rel(FIXTURES)}")
    return 0 if all(outcome.passed for _, outcome, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
