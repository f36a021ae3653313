"""The decoding room: what happens to a row of logits before its token is chosen, and what is reported of it.

Nothing here knows processes or messages; the attention side (`serving.workers.attention`) applies these to the
rows it samples, and the front end checks the options and formats what comes back.

- `sampling`: greedy and random sampling (temperature, top-p, top-k, a seeded generator per sequence) and the
  stop rules of generation.
- `options`: `DecodeOptions`, one request's per-sequence settings beyond temperature, top-p and top-k (log-
  probabilities, penalties, logit bias, minimum tokens, stop token ids, a grammar), as they travel to a worker.
- `logprobs`: the log-probabilities of a chosen token and of the most likely ones, from fp32 logits, for
  generated tokens and for the prompt's own tokens (`echo`).
- `processors`: the logits a sequence's options change (minimum tokens, logit bias, repetition, frequency and
  presence penalties), in vLLM's order.
- `grammar`: structured output with xgrammar: a JSON schema or any JSON object as a token mask per step, its
  state per sequence.

Nothing is imported here, so importing the package stays cheap.
"""
