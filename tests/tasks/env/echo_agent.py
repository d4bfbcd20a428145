"""A black-box agent for the ``cmd:`` harness test: the official openai client, configured by
nothing but the environment (OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL), reporting
through GYRE_OUTPUT.

It asks the model once per turn (so the calls are recorded), then answers each turn with the
word the prompt names (so the score does not depend on a random model)."""

import json
import os

from openai import OpenAI

with open(os.environ["GYRE_TASK_FILE"]) as f:
    task = json.load(f)
client = OpenAI(max_retries=0)
answers = {}
for turn in task["turns"]:
    resp = client.chat.completions.create(
        model=os.environ["OPENAI_MODEL"],  # the name the gateway serves the policy as
        messages=[
            {"role": "system", "content": task["system_prompt"]},
            {"role": "user", "content": turn["prompt"]},
        ],
        max_tokens=4,
    )
    word = turn["prompt"].removeprefix("Say ").rstrip(".")
    answers[turn["turn_id"]] = {"text": word, "request_id": resp.id}
with open(os.environ["GYRE_OUTPUT"], "w") as f:
    json.dump({"answers": answers, "calls": len(answers)}, f)
