"""A broken black-box agent for the ``cmd:`` harness: the official openai client, configured
by the environment, asking for a model the gateway does not serve (every call gets 404)."""

import json
import os

from openai import OpenAI

with open(os.environ["GYRE_TASK_FILE"]) as f:
    task = json.load(f)
client = OpenAI(max_retries=0)
client.chat.completions.create(
    model="gpt-no-such-model",
    messages=[{"role": "user", "content": "hello"}],
    max_tokens=4,
)
