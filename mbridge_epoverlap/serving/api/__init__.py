"""The OpenAI API's fields beyond prompts and sampling settings, and their answers: what the server checks and
builds for log-probabilities, several choices, penalties, structured output and tool calls.

- `errors`: `ApiError`, a refusal as OpenAI's error body naming the field, and the helpers every check shares.
- `served_model`: `ModelInfo`, what the checks need of the served model (vocabulary, context, tokenizer, limits).
- `decode_fields`: `logprobs`, `top_logprobs`, `echo`, `n`, `best_of`, the penalties, `logit_bias`, `min_tokens`,
  `stop_token_ids` and `response_format` checked, as the sequences' `DecodeOptions` and the request's `Choices`.
- `tools`: `tools` and `tool_choice` ("required", a named function, "none") as a grammar, and the answer's
  `tool_calls`.
- `logprobs`: log-probability records as OpenAI's completion and chat objects.
- `choices`: one request's engine sequences followed to their choices: text, echo, log-probabilities, tool
  calls, and the best of `best_of`.

Nothing is imported here, so importing the package stays cheap.
"""
