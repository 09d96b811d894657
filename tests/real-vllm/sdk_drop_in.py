"""The drop-in check of #34 with the clients agents use: the Anthropic SDK's messages.create and
messages.stream, and the OpenAI SDK's responses.create (unary and streamed), sent directly to a
real vLLM server and through kvgate, greedy: the same text and the same usage. Then two-turn
`previous_response_id` conversations through kvgate in front of two workers with vLLM's response
store on: each second turn must reach the worker that stored the first, and answer as the same
conversation does direct.

    python sdk_drop_in.py GATEWAY_URL DIRECT_URL MODEL
Exit status 0 when every check holds; prints one line per check.
"""
import sys

import anthropic
import openai

gateway, direct, model = sys.argv[1], sys.argv[2], sys.argv[3]
MAX = 12


def anthropic_client(url):
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def openai_client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def check(name, a, b):
    if a != b:
        print(f"FAIL {name}:\n  direct:  {a!r}\n  gateway: {b!r}")
        sys.exit(1)
    print(f"ok   {name}")


CONVERSATIONS = [
    [{"role": "user", "content": "Say hello to the cache router."}],
    [
        {"role": "user", "content": [{"type": "text", "text": "List three colours."}]},
        {"role": "assistant", "content": "red, green"},
        {"role": "user", "content": "and one more"},
    ],
]


def messages_args(msgs, system):
    # Greedy through extra_body: this SDK's signature has no temperature.
    args = dict(model=model, max_tokens=MAX, messages=msgs, extra_body={"temperature": 0})
    if system:
        args["system"] = system
    return args


def messages_unary(url, msgs, system):
    r = anthropic_client(url).messages.create(**messages_args(msgs, system))
    return ([b.text for b in r.content if b.type == "text"], r.stop_reason, r.usage.input_tokens, r.usage.output_tokens)


def messages_stream(url, msgs, system):
    with anthropic_client(url).messages.stream(**messages_args(msgs, system)) as s:
        kinds = [e.type for e in s if e.type in ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop")]
        final = s.get_final_message()
    return (kinds, [b.text for b in final.content if b.type == "text"], final.stop_reason, final.usage.input_tokens, final.usage.output_tokens)


def responses_unary(url, inp, instructions):
    r = openai_client(url).responses.create(model=model, input=inp, instructions=instructions, max_output_tokens=MAX, temperature=0)
    return (r.output_text, r.status, r.usage.input_tokens, r.usage.output_tokens)


def responses_stream(url, inp, instructions):
    events = list(openai_client(url).responses.create(model=model, input=inp, instructions=instructions, max_output_tokens=MAX, temperature=0, stream=True))
    kinds = [e.type for e in events if not e.type.endswith(".delta")]
    seqs = [e.sequence_number for e in events]
    done = [e for e in events if e.type == "response.completed"]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"sequence numbers {seqs}"
    assert len(done) == 1, kinds
    r = done[0].response
    return (kinds, r.output_text, r.usage.input_tokens, r.usage.output_tokens)


for i, msgs in enumerate(CONVERSATIONS):
    system = "You are terse." if i else None
    check(f"messages.create #{i}", messages_unary(direct, msgs, system), messages_unary(gateway, msgs, system))
    check(f"messages.stream #{i}", messages_stream(direct, msgs, system), messages_stream(gateway, msgs, system))
    inp = msgs[0]["content"] if i == 0 else [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]} for m in msgs]
    check(f"responses.create #{i}", responses_unary(direct, inp, system), responses_unary(gateway, inp, system))
    check(f"responses.create(stream) #{i}", responses_stream(direct, inp, system), responses_stream(gateway, inp, system))


def two_turns(url, n):
    c = openai_client(url)
    first = c.responses.create(model=model, input=f"Conversation {n}: remember the number {n}.", max_output_tokens=MAX, temperature=0, store=True)
    second = c.responses.create(model=model, previous_response_id=first.id, input="What was the number?", max_output_tokens=MAX, temperature=0, store=True)
    fetched = c.responses.retrieve(second.id)
    return (first.output_text, second.output_text, second.usage.input_tokens, fetched.id == second.id, fetched.output_text)


# Four conversations: with two workers and no affinity, some second turn would land on the
# worker that does not hold the first (and get vLLM's 404).
for n in range(4):
    check(f"previous_response_id conversation {n}", two_turns(direct, n), two_turns(gateway, n))
print("all checks passed")
