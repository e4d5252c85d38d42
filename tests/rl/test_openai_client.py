"""The official `openai` client against a rollout server started here on 127.0.0.1: what an evaluation harness or
a user's script does, with nothing of ours on the client side."""
import openai
import pytest
from rl_helpers import serve_rollout


@pytest.fixture
def client(rollout):
    return openai.OpenAI(base_url=f"{rollout['url']}/v1", api_key="unused", max_retries=0, timeout=30)


def test_completions_with_n_logprobs_alternatives_and_seed_reproduce(client):
    kwargs = dict(model="local", prompt="3+4=", max_tokens=5, n=3, logprobs=2, seed=2**64 - 1, temperature=1.0)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    for choice in first.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) >= 1
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
        assert choice.finish_reason in ("stop", "length")
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert first.model_extra["weight_version"] == 0  # our field, kept by the client


@pytest.fixture
def served(rollout):
    return rollout, openai.OpenAI(base_url=f"{rollout['url']}/v1", api_key="unused", max_retries=0, timeout=30)


def test_echo_with_logprobs_scores_the_prompt_as_a_plain_forward_does(served):
    import torch

    rollout, client = served
    answer = client.completions.create(model="local", prompt="3+4=", max_tokens=3, n=2, logprobs=2, echo=True,
                                       seed=7, temperature=0.8)
    prompt = rollout["server"].model.tokenizer.encode("3+4=")
    with torch.no_grad():
        logp = torch.log_softmax(rollout["engine"].model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    want = logp.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    plain = client.completions.create(model="local", prompt="3+4=", max_tokens=3, n=2, logprobs=2, seed=7,
                                      temperature=0.8)
    for choice, alone in zip(answer.choices, plain.choices):
        lp, p = choice.logprobs, len(prompt)
        assert choice.text == "3+4=" + alone.text  # scoring the prompt changes no sampled token
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
        assert lp.token_logprobs[1:p] == pytest.approx(want, abs=1e-5)
        assert lp.token_logprobs[p:] == pytest.approx(alone.logprobs.token_logprobs, abs=1e-5)
        assert lp.tokens[p:] == alone.logprobs.tokens
        for top, best in zip(lp.top_logprobs[1:p], logp.topk(2, -1).values.tolist()):
            assert sorted(top.values(), reverse=True) == pytest.approx(best, abs=1e-5)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == p + 3
        assert lp.text_offset[:p] == [0] + [*range(p - 1)]  # "<bos>" shows as no text, then one character each
        assert lp.text_offset[p] == len("3+4=")


def test_streamed_completions_match_and_stop_strings_cut(client):
    whole = client.completions.create(model="local", prompt="1+", max_tokens=8, seed=4)
    text = whole.choices[0].text
    streamed = client.completions.create(model="local", prompt="1+", max_tokens=8, seed=4, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    stop = next((text[i:i + 1] for i in range(1, len(text)) if text[i] != "\ufffd"), None)
    if stop is not None:
        cut = client.completions.create(model="local", prompt="1+", max_tokens=8, seed=4, stop=[stop])
        assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_models_list_and_errors_raise_the_clients_exceptions(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["local"] and models[0].created > 0
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="local", prompt="3+4=", max_tokens=2, n=99)
    assert err.value.body["param"] == "n" and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="3+4=", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="local", messages=[{"role": "user", "content": "3+4="}])
    assert err.value.body["param"] == "messages"  # the built-in vocabulary has no chat template


# The built-in vocabulary as a Hugging Face model directory with a chat template: each turn's text, then "=".
TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}={% endif %}")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from moe_rl_eks.workloads.rl.tokenizer import load_model_tokenizer, write_tokenizer_files

    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files("builtin", directory)
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    for server in serve_rollout(tmp_path_factory.mktemp("chat"), tokenizer=load_model_tokenizer(directory)):
        yield openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0, timeout=30)


def test_chat_completions_render_the_template_and_reproduce_with_a_seed(chat):
    messages = [{"role": "system", "content": "1+1"}, {"role": "user", "content": "+2"}]
    kwargs = dict(model="local", messages=messages, max_tokens=6, n=2, seed=9, logprobs=True, top_logprobs=2,
                  extra_body={"return_token_ids": True})
    first = chat.chat.completions.create(**kwargs)
    assert first.choices[0].model_extra["prompt_token_ids"] == [1, 4, 13, 4, 13, 5, 16]  # <bos>1+1+2=
    assert first.usage.prompt_tokens == 7
    assert [c.message.content for c in chat.chat.completions.create(**kwargs).choices] == \
        [c.message.content for c in first.choices]
    for choice in first.choices:
        assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
        content = choice.logprobs.content
        assert len(content) == len(choice.model_extra["token_ids"])
        assert all(1 <= len(t.top_logprobs) <= 2 and t.logprob <= 0 for t in content)


def test_streamed_chat_adds_up_to_the_whole_answer(chat):
    kwargs = dict(model="local", messages=[{"role": "user", "content": "2*3"}], max_tokens=6, seed=3)
    whole = chat.chat.completions.create(**kwargs).choices[0]
    chunks = list(chat.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    text = whole.message.content
    if text:
        cut = chat.chat.completions.create(**kwargs, stop=[text[-1]]).choices[0]
        assert cut.message.content == text[:text.index(text[-1])] and cut.finish_reason == "stop"
