"""llama.cpp's own server test suite, pointed at `moestream serve`: which of its tests fail, and why.

    python benchmarks/llamacpp_server_tests.py STORE --tests LLAMA_CPP/tools/server/tests [--files F ...] [--json OUT]

LLAMA_CPP is a llama.cpp source tree (llama-cpp-python's source distribution carries one under
vendor/llama.cpp). Nothing of it is copied here: its tests run where they are, with pytest, and this file
is loaded into that pytest as a plugin (`-p llamacpp_server_tests`) that swaps the launcher. Its
`ServerProcess.start` starts `moestream serve STORE` instead of `llama-server`, translating what has a
counterpart (port, host, model alias, parallel slots, default answer length, chat template file); its
`ServerPreset.load_all` (which downloads llama.cpp's test models) does nothing. Requests through the
`openai` client carry the served model name (llama.cpp answers any name, moestream answers 404 to one it
does not serve, as OpenAI does). Their tests need `requests`, `wget`, `openai` and `filelock` beside pytest.

Every failure is then classified by CLASSIFIED below (the first matching pattern on the test's id):
- content-only: the test asserts the text or token counts of llama.cpp's test model (stories260K), which
  another model cannot reproduce;
- llama.cpp-only: the test exercises something outside OpenAI's API (llama.cpp's own endpoints and
  fields, GBNF grammars, slots, LoRA, embeddings, Anthropic's API...);
- gap: something OpenAI's API defines for chat or completions that moestream does not do.
A failure no pattern matches is printed as "unclassified" with its message, to be looked at.

Prints one line per failure and a count per class; --json writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# The files that exercise what OpenAI's API defines (chat, completions, models, streaming, tools, errors).
DEFAULT_FILES = [
    "test_basic.py",
    "test_chat_completion.py",
    "test_completion.py",
    "test_tool_call.py",
    "test_compat_oai_responses.py",
    "test_ignore_eos.py",
    "test_security.py",
]

CONTENT, LLAMA, GAP = "content-only", "llama.cpp-only", "gap"

# (pattern on the test id, class, why). First match wins; each was read in the test's source.
CLASSIFIED: list[tuple[str, str, str]] = [
    # llama.cpp's own endpoints and request/response fields
    (
        r"test_basic::test_(load_split_model|server_props|server_slots|no_ui|server_model_aliases_and_tags)",
        LLAMA,
        "llama.cpp's /props, /slots, web UI, split GGUF, model aliases and tags",
    ),
    (r"test_basic::test_server_multiple_addresses", LLAMA, "--host with a comma-separated list of addresses"),
    (
        r"test_chat_completion::test_apply_chat_template|test_chat_completions_token_count",
        LLAMA,
        "llama.cpp's /apply-template and /tokenize",
    ),
    (
        r"test_chat_completion::test_chat_completion\[codellama70b",
        LLAMA,
        "llama.cpp answers any model name; moestream answers 404 to one it does not serve, as OpenAI and vLLM do",
    ),
    (r"test_chat_completion::test_chat_completion\[", CONTENT, "the text and token counts of llama.cpp's test model"),
    (
        r"test_chat_completion::test_chat_completion_cached_tokens",
        CONTENT,
        "prompt token counts of llama.cpp's test model's tokenizer (cached_tokens itself is reported)",
    ),
    (
        r"test_chat_completion::test_chat_completion_stream",
        LLAMA,
        'expects the first chunk\'s content null; OpenAI (and moestream) send "" beside the role',
    ),
    (
        r"test_chat_completion::test_chat_completion_with_timings_per_token|test_return_progress|test_verbose_debug|"
        r"test_chat_template\b|test_chat_template_assistant_prefill",
        LLAMA,
        "llama.cpp's timings_per_token, return_progress, __verbose fields",
    ),
    (r"test_chat_completion::test_chat_completions_multiple_choices", LLAMA, "llama.cpp's id_slot field (n=2 itself is served)"),
    (
        r"test_chat_template_continue_final_message_vllm_compat",
        LLAMA,
        "vLLM's continue_final_message/add_generation_prompt fields, outside OpenAI's schema",
    ),
    (r"test_completion_with_grammar|test_invalid_grammar", LLAMA, "GBNF grammars (structured outputs take json_schema)"),
    (r"test_completion_with_json_schema", LLAMA, "a top-level json_schema field (OpenAI's is response_format)"),
    (r"test_completion_with_response_format\[response_format[01]-", LLAMA, "json_object with a schema (an extension)"),
    (
        r"test_completion_with_response_format\[response_format2-",
        LLAMA,
        "json_schema without its required name (OpenAI and vLLM refuse it too)",
    ),
    (
        r"test_context_size_exceeded",
        LLAMA,
        "llama.cpp's error type exceed_context_size_error; moestream answers OpenAI's invalid_request_error "
        "with code context_length_exceeded",
    ),
    (
        r"test_invalid_chat_completion_req\[messages7\]",
        LLAMA,
        "two assistant messages in a row are refused by llama.cpp, accepted by OpenAI",
    ),
    (
        r"test_compat_oai_responses::test_responses_stream_with_llama_telemetry",
        LLAMA,
        "llama.cpp's timing fields (timings_per_token, return_progress)",
    ),
    (
        r"test_compat_oai_responses::test_responses_(with_openai_library|stream_with_openai_library|with_text_format)",
        CONTENT,
        "the text of llama.cpp's test model (Suddenly)",
    ),
    # /completion and /completions are llama.cpp's native endpoint (content, n_probs, slots, tokens, ...)
    (
        r"test_completion::test_(cancel_request|completion\[|completion_parallel_slots|completion_prompt_cache|"
        r"completion_response_fields|completion_stream\[|completion_stream_vs_non_stream|completion_unified|"
        r"completion_with_tokens_input|consistent_result|different_result|json_prompt_no_mtmd|logit_bias|n_probs|"
        r"nocache_long_input_prompt)",
        LLAMA,
        "llama.cpp's native /completion endpoint and its fields (content, n_probs, /slots)",
    ),
    (r"test_ignore_eos::", LLAMA, "llama.cpp's native /completion endpoint"),
    (r"test_security::test_correct_api_key\b", LLAMA, "the key is accepted; the test reads the native endpoint's content field"),
    (r"test_security::test_correct_api_key_anthropic_header", LLAMA, "Anthropic's X-Api-Key header"),
    (
        r"test_security::test_incorrect_api_key",
        LLAMA,
        "401 is answered; llama.cpp's error type authentication_error, OpenAI's (and moestream's) invalid_request_error "
        "with code invalid_api_key",
    ),
    (
        r"test_security::test_(access_static_assets|cors_|local_media_file)",
        LLAMA,
        "the web UI's assets, CORS for browsers, local image files",
    ),
    (
        r"test_tool_call::test_completion_without_tool_call_fast.*STREAMED|test_chat_completion::test_logprobs_stream",
        LLAMA,
        'the harness refuses an empty content delta; OpenAI (and moestream) open a stream with content ""',
    ),
    (
        r"test_chat_completion::test_chat_completion_with_openai_library|test_completion::test_completion_with_openai_library",
        LLAMA,
        "asserts llama.cpp's system_fingerprint (its build, b...); moestream's is moestream-VERSION-STORE",
    ),
    (r"test_chat_completion::test_logit_bias", LLAMA, "llama.cpp's /tokenize (logit_bias itself is served and tested)"),
    (r"test_completion::test_completion_stream_with_openai_library", CONTENT, "the text of llama.cpp's test model"),
]


# ---- the plugin: loaded into llama.cpp's pytest with -p ----


def pytest_configure(config) -> None:
    store = os.environ.get("MOESTREAM_STORE")
    if not store:
        return
    import utils  # llama.cpp's tests/utils.py, importable since pytest runs in that directory

    def start(self, timeout_seconds: int = 120) -> None:
        command = [str(Path(sys.executable).with_name("moestream")), "serve", store]
        command += ["--host", self.server_host, "--port", str(self.server_port), "--log-level", "warning"]
        if self.model_alias:
            command += ["--model-name", self.model_alias]
        if self.n_slots:
            command += ["--max-batch", str(self.n_slots)]
        if self.n_predict and self.n_predict > 0:
            command += ["--default-max-tokens", str(self.n_predict)]
        if self.chat_template_file:
            command += ["--chat-template", self.chat_template_file]
        if self.api_key:
            command += ["--api-key", self.api_key]
        print("tests: starting", " ".join(command))
        SERVED["name"] = self.model_alias
        self.process = subprocess.Popen(command)
        utils.server_instances.add(self)
        deadline = time.time() + timeout_seconds
        while time.time() < deadline:
            try:
                if self.make_request("GET", "/health").status_code == 200:
                    self.ready = True
                    return
            except Exception:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"moestream serve exited with {self.process.returncode}")
            time.sleep(0.1)
        raise TimeoutError(f"moestream serve did not answer /health within {timeout_seconds} s")

    utils.ServerProcess.start = start
    utils.ServerPreset.load_all = staticmethod(lambda: None)
    _send_the_served_model_name()


# The model name the running server serves (set by the swapped launcher).
SERVED: dict[str, str | None] = {"name": None}


def _send_the_served_model_name() -> None:
    """llama.cpp answers any model name; moestream, as OpenAI and vLLM, answers 404 to a name it does not
    serve. So that the rest of a test that sends another name ("gpt-3.5-turbo") runs, requests go out
    with the served one (the tests that check the name itself are classified)."""
    import openai.resources.chat.completions as chat
    import openai.resources.completions as completions

    for cls in (chat.Completions, completions.Completions):
        create = cls.create

        def create_with_served_name(self, *args, _create=create, **kwargs):
            if SERVED["name"] and "model" in kwargs:
                kwargs["model"] = SERVED["name"]
            return _create(self, *args, **kwargs)

        cls.create = create_with_served_name


# ---- the runner ----


def classify(test_id: str) -> tuple[str, str]:
    for pattern, kind, why in CLASSIFIED:
        if re.search(pattern, test_id):
            return kind, why
    return "unclassified", ""


def reclassify(path: str) -> dict:
    """Outcomes written earlier by --json, classified again by the current CLASSIFIED (no test is run)."""
    outcomes = json.loads(Path(path).read_text())
    for failure in outcomes["failed"]:
        failure["class"], failure["why"] = classify(failure["test"])
    return outcomes


def run(args) -> dict:
    if not args.tests:
        sys.exit("--tests: name llama.cpp's tools/server/tests directory")
    tests = Path(args.tests).resolve()
    if not (tests / "utils.py").is_file() or not (tests / "unit").is_dir():
        sys.exit(f"{tests} is not llama.cpp's tools/server/tests (no utils.py and unit/ there)")
    env = dict(os.environ, MOESTREAM_STORE=str(Path(args.store).resolve()))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        command = [sys.executable, "-m", "pytest", "-p", "llamacpp_server_tests", "-p", "no:cacheprovider", "-q"]
        command += [f"--junitxml={report}", "-o", "junit_logging=no"] + [f"unit/{f}" for f in args.files]
        command += ["-k", args.k] if args.k else []
        command += [] if args.slow else ["-m", "not slow"]  # as llama.cpp's tests.sh runs them by default
        started = time.time()
        subprocess.run(command, cwd=tests, env=env, stdout=None if args.verbose else subprocess.DEVNULL)
        seconds = time.time() - started
        root = ET.parse(report).getroot()
    outcomes = {"passed": 0, "skipped": 0, "failed": []}
    for case in root.iter("testcase"):
        test_id = f"{Path(case.get('file') or case.get('classname', '').replace('.', '/')).stem}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if case.find("skipped") is not None:
            outcomes["skipped"] += 1
        elif problem is None:
            outcomes["passed"] += 1
        else:
            kind, why = classify(test_id)
            message = (problem.get("message") or "").splitlines()[0][:200] if problem.get("message") else ""
            outcomes["failed"].append({"test": test_id, "class": kind, "why": why, "message": message})
    outcomes["seconds"] = round(seconds, 1)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", help="the store `moestream serve` serves")
    parser.add_argument("--tests", help="llama.cpp's tools/server/tests directory (needed unless --reclassify)")
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="test files under unit/")
    parser.add_argument("-k", help="pytest -k expression, to run a subset")
    parser.add_argument("--slow", action="store_true", help="also the tests llama.cpp marks slow (real models' tool calls)")
    parser.add_argument("--json", help="also write the outcomes here")
    parser.add_argument("--verbose", action="store_true", help="show pytest's output")
    parser.add_argument("--reclassify", metavar="JSON", help="classify the outcomes of an earlier --json again; run nothing")
    parser.add_argument(
        "--record",
        nargs="?",
        const="llamacpp-server-tests",
        metavar="CAPABILITY",
        help="write the counts as this machine's record of CAPABILITY (default llamacpp-server-tests; benchmarks/machine.py)",
    )
    args = parser.parse_args()
    outcomes = reclassify(args.reclassify) if args.reclassify else run(args)
    counts: dict[str, int] = {}
    for failure in sorted(outcomes["failed"], key=lambda f: (f["class"], f["test"])):
        counts[failure["class"]] = counts.get(failure["class"], 0) + 1
        print(f"{failure['class']:<15} {failure['test']}: {failure['why'] or failure['message']}")
    print(
        f"\n{outcomes['passed']} passed, {outcomes['skipped']} skipped, {len(outcomes['failed'])} failed "
        f"({', '.join(f'{k}: {v}' for k, v in sorted(counts.items())) or 'none'}) in {outcomes['seconds']} s"
    )
    if args.json:
        import machine  # beside this file

        if "machine" in outcomes:  # --reclassify: the earlier run's machine
            Path(args.json).write_text(json.dumps(outcomes, indent=1) + "\n")
        else:
            machine.write_json(args.json, outcomes)
    if args.record and not args.reclassify:  # a record is this machine's run, not an earlier one's
        import machine  # beside this file

        total = outcomes["passed"] + outcomes["skipped"] + len(outcomes["failed"])
        columns = ["tests", "passed", "skipped", "failed", *(f"of them {k}" for k in sorted(counts)), "time"]
        row = [
            total,
            outcomes["passed"],
            outcomes["skipped"],
            len(outcomes["failed"]),
            *(counts[k] for k in sorted(counts)),
            f"{outcomes['seconds']} s",
        ]
        caption = f"llama.cpp's server tests ({', '.join(args.files)}){'' if args.slow else ', without those it marks slow'}, against `moestream serve`:"
        title = "llama.cpp's server tests against `moestream serve`"
        notes = "Every failure is classified in the script (`CLASSIFIED`): llama.cpp-only, content-only, or a gap."
        path = machine.write_result(args.record, title, machine.invocation(), [machine.table(caption, columns, [row])], notes)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
