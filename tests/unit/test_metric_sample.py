"""omni_tools.server.metric_sample: one sample out of Prometheus text, as Triton writes it."""
from __future__ import annotations

import pytest

from omni_tools.server import metric_sample

TEXT = """\
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="llm",version="1"} 12
nv_inference_count{model="omni",version="1"} 3
# HELP omni_llm_generation_tokens_total Tokens generated
# TYPE omni_llm_generation_tokens_total counter
omni_llm_generation_tokens_total{model="llm",version="1"} 1500
omni_llm_generation_tokens_total{model="talker",version="1"} 6000
# HELP omni_stage_latency_seconds Seconds per stage
# TYPE omni_stage_latency_seconds histogram
omni_stage_latency_seconds_count{model="omni",stage="thinker",version="1"} 4
omni_stage_latency_seconds_sum{model="omni",stage="thinker",version="1"} 1.25
omni_stage_latency_seconds_bucket{model="omni",stage="thinker",version="1",le="0.5"} 3
omni_stage_latency_seconds_bucket{model="omni",stage="thinker",version="1",le="+Inf"} 4
omni_stage_latency_seconds_count{model="omni",stage="talker",version="1"} 2
omni_stage_latency_seconds_sum{model="omni",stage="talker",version="1"} 0.5
omni_stage_latency_seconds_bucket{model="omni",stage="talker",version="1",le="+Inf"} 2
"""


@pytest.mark.parametrize("name, labels, value", [
    ("nv_inference_count", {"model": "omni"}, 3),
    ("omni_llm_generation_tokens_total", {"model": "talker"}, 6000),
    ("omni_llm_generation_tokens_total", {"model": "llm"}, 1500),
    ("omni_llm_generation_tokens", {"model": "llm"}, 1500),  # a counter, with or without _total
    ("omni_stage_latency_seconds_count", {"model": "omni", "stage": "talker"}, 2),
    ("omni_stage_latency_seconds_sum", {"model": "omni", "stage": "thinker"}, 1.25),
    ("omni_stage_latency_seconds_bucket", {"stage": "thinker", "le": "0.5"}, 3),
])
def test_the_sample_with_those_labels(name, labels, value):
    assert metric_sample(TEXT, name, **labels) == value


@pytest.mark.parametrize("name, labels", [
    ("omni_llm_generation_tokens_total", {"model": "dit"}),  # no such model
    ("omni_stage_latency_seconds", {"model": "omni"}),  # a histogram's name, not a sample's
    ("omni_stage_latency_seconds_count", {"stage": "audio_decoder"}),
])
def test_no_match_is_a_key_error_naming_what_was_asked(name, labels):
    with pytest.raises(KeyError, match=name):
        metric_sample(TEXT, name, **labels)
