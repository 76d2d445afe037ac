"""The chat template's options (vLLM's names): the generation prompt, or the last message
left open for the model to continue."""
import pytest

from engine import SamplingParams
from engine.errors import InvalidRequestError

FRUIT = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The fruit is"}]


def test_the_options_give_the_templates_prompts(llm, tokenizer):
    engine = llm.llm_engine
    for options in ({}, {"add_generation_prompt": False},
                    {"add_generation_prompt": False, "continue_final_message": True}):
        prompt = engine.chat_prompt(FRUIT, **options)
        expected = tokenizer.apply_chat_template(FRUIT, tokenize=False, **{"add_generation_prompt": True, **options})
        assert prompt["prompt"] == expected
        assert prompt["prompt_token_ids"] == tokenizer(expected, add_special_tokens=False).input_ids
    assert engine.chat_prompt(FRUIT, add_generation_prompt=False, continue_final_message=True)["prompt"] \
        .endswith("<|im_start|>assistant\nThe fruit is")


def test_continuing_the_last_message_generates_its_continuation(llm):
    continued = llm.chat(FRUIT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                         add_generation_prompt=False, continue_final_message=True)[0]
    prompt = llm.llm_engine.chat_prompt(FRUIT, add_generation_prompt=False, continue_final_message=True)
    by_ids = llm.generate({"prompt_token_ids": prompt["prompt_token_ids"]},
                          SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert continued.prompt_token_ids == prompt["prompt_token_ids"]
    assert continued.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_both_options_at_once_are_refused(llm):
    with pytest.raises(InvalidRequestError, match="add_generation_prompt to false") as error:
        llm.llm_engine.chat_prompt(FRUIT, add_generation_prompt=True, continue_final_message=True)
    assert error.value.param == "continue_final_message"
