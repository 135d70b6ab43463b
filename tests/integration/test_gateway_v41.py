"""The gateway's behaviour on a DeepSeek-V4.1 model: the embedded mesh's tests over the tiny-v41
preset (its encoding, tokenizer, engine and bounded prefix reuse; the gateway fixtures are
tests/integration/conftest.py's), in a module of their own so that the two families run side by
side in `make test`'s parallel part."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from common.blocks import BLOCK_SIZE
from tests.support.batch_behaviour import BatchBehaviour
from tests.support.behaviour import GREEDY, MODEL, GatewayBehaviour, ModelOutputBehaviour, one_process_answer
from tests.support.v41_reference import reference_logits


@pytest.fixture(scope="module")
def model(tiny_v41_preset):
    return tiny_v41_preset


# Checked on DeepSeek-V4 only: what they check happens in the gateway, the job store or the
# tokenizer service's validation, whose code and answers do not depend on the model family.
MODEL_INDEPENDENT = [
    "test_completions_refuse_what_they_cannot_do",
    "test_an_output_constraint_that_cannot_be_enforced_is_a_400_naming_why",
    "test_a_background_response_is_polled_resumed_by_sequence_number_and_cancelled",
    "test_models_health_and_metrics",
    "test_errors_use_each_protocols_body",
    "test_hostile_bodies_get_a_4xx_in_the_protocols_shape_on_a_connection_that_stays_usable",
    "test_a_request_that_breaks_the_protocol_layer_fails_alone",
    "test_a_client_that_leaves_stops_its_job",
    "test_job_errors",
    "test_an_input_file_that_is_not_a_batch_fails_it_with_every_bad_line",
    "test_more_than_50000_requests_fail_validation",
    "test_a_file_over_200_mb_is_refused_with_413",
    # the job store's replay and the batch runner's rounds and cancellation: what a request
    # answers is checked above for this family, how jobs carry it is the same for both
    "test_a_jobs_replayed_events_are_its_live_stream_and_its_answer",
    "test_a_batch_answers_every_custom_id_as_the_request_alone_would",
    "test_cancel_stops_the_rest_and_keeps_what_finished",
]


class TestEmbeddedV41(GatewayBehaviour):
    def test_a_repeated_long_prompt_starts_where_its_kept_tokens_begin(self, service, oai):
        """V4.1 computes a prompt's last KEEP tokens (140) whatever is stored: a repeated 600-token
        prompt reports its first 600 - KEEP tokens as cached, where its first run stored its state,
        and answers as its first run did; the first token is the independent oracle's (DeepInfer's
        and SGLang's code, with the same truncation)."""
        keep = service.mesh.prefill.engine.config.prefill_keep_tokens
        assert keep == 140  # DeepInfer's default, what a served V4.1 model runs with
        prompt = [(7 * i + 11) % 100_000 + 3 for i in range(600)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1}
        first = oai.completions.create(**body)
        again = oai.completions.create(**body)
        assert not (first.usage.prompt_tokens_details and first.usage.prompt_tokens_details.cached_tokens)
        assert again.usage.prompt_tokens_details.cached_tokens == 600 - keep == 460
        assert again.choices[0].text == first.choices[0].text
        assert again.choices[0].logprobs.token_logprobs == pytest.approx(
            first.choices[0].logprobs.token_logprobs, abs=1e-4
        )
        tokenizer = Tokenizer.from_file(str(service.model / "tokenizer.json"))
        best = int(reference_logits(service.model, prompt, keep_tokens=keep)[-1].argmax())
        assert first.choices[0].logprobs.tokens[0] == tokenizer.decode([best], skip_special_tokens=False)

    def test_a_long_conversations_next_turn_starts_where_the_first_turns_kept_tokens_begin(self, service, oai, claude):
        """A first turn of about 600 tokens and its follow-up, over the OpenAI and Anthropic SDKs: the
        follow-up reports as cached all of the first turn that turn could reuse itself (all but its
        last KEEP tokens, whose state it stored) and answers as a cold one-process run of the whole
        conversation."""
        keep = service.mesh.prefill.engine.config.prefill_keep_tokens
        long = " ".join(f"item {i} of the inventory;" for i in range(100))
        first = [{"role": "user", "content": f"{long} ({service.url}) Which item is last?"}]
        turn_1 = oai.chat.completions.create(model=MODEL, messages=first, max_tokens=6, **GREEDY)
        second = [*first, {"role": "assistant", "content": turn_1.choices[0].message.content}]
        second.append({"role": "user", "content": "And the first?"})
        turn_2 = claude.messages.create(
            model=MODEL, max_tokens=6, messages=second, thinking={"type": "disabled"}, extra_body={"temperature": 0}
        )
        prompt_1, prompt_2 = (
            turn_1.usage.prompt_tokens,
            turn_2.usage.input_tokens + turn_2.usage.cache_read_input_tokens,
        )
        assert (
            prompt_1 > keep + BLOCK_SIZE and prompt_2 - keep < prompt_1
        )  # reuse is bounded below the first turn's end
        assert turn_2.usage.cache_read_input_tokens == prompt_1 - keep > 0
        cold = {"model": MODEL, "messages": second, "max_tokens": 6, "temperature": 0, "thinking": {"type": "disabled"}}
        expected = one_process_answer(service.model, cold, "messages")
        assert [block.model_dump(exclude_none=True) for block in turn_2.content] == expected["content"]


class TestEmbeddedV41ModelOutput(ModelOutputBehaviour):
    pass


class TestEmbeddedV41Batches(BatchBehaviour):
    pass


for name in MODEL_INDEPENDENT:
    setattr(TestEmbeddedV41 if hasattr(GatewayBehaviour, name) else TestEmbeddedV41Batches, name, None)
