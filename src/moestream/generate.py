"""Text generation on a loaded model, streamed to a callback, with the timings users ask about."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import TextStreamer

from .runtime import engine_of


class _TimingStreamer(TextStreamer):
    """transformers' streamer that also notes when the first new token arrived and can stay silent."""

    def __init__(self, tokenizer, echo: bool):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.echo = echo
        self.first_token_at: float | None = None
        self.text = ""

    def put(self, value):
        if not self.next_tokens_are_prompt and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.text += text
        if self.echo:
            print(text, flush=True, end="" if not stream_end else None)


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    token_ids: list[int]
    seconds: float
    time_to_first_token: float
    decode_tokens_per_second: float
    stats: dict = field(default_factory=dict)

    def summary(self) -> str:
        s = self.stats
        return (
            f"{len(self.token_ids)} tokens | {self.decode_tokens_per_second:.2f} tok/s decode | "
            f"TTFT {self.time_to_first_token:.2f}s | hit rate {s['hit_rate']:.1%} | "
            f"read {s['bytes_read'] / 1e6:.1f} MB | peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB"
        )


def generate(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 64,
    *,
    greedy: bool = False,
    temperature: float = 0.7,
    top_p: float = 0.95,
    seed: int | None = None,
    echo: bool = False,
) -> GenerationResult:
    if seed is not None:
        torch.manual_seed(seed)
    inputs = tokenizer(prompt, return_tensors="pt")
    streamer = _TimingStreamer(tokenizer, echo)
    engine = engine_of(model)
    engine.reset_stats()
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            streamer=streamer,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            **sampling,
        )
    end = time.perf_counter()
    new = output[0, inputs["input_ids"].shape[1] :].tolist()
    first = streamer.first_token_at or end
    decode_rate = (len(new) - 1) / (end - first) if len(new) > 1 and end > first else 0.0
    return GenerationResult(
        text=streamer.text,
        prompt_tokens=int(inputs["input_ids"].shape[1]),
        token_ids=new,
        seconds=end - start,
        time_to_first_token=first - start,
        decode_tokens_per_second=decode_rate,
        stats=engine.stats(),
    )
