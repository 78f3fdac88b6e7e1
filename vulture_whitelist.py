"""Names that frameworks call or read by name, which vulture cannot see used: `make lint` passes this file to vulture.

Not imported by anything. Each line names the framework that uses the name: pydantic fields read through getattr
(train.<method>, schedule.*), Flower's Strategy interface, MLflow's PythonModel.load_context, Great Expectations'
expectation attributes, transformers' TrainerCallback and config attributes, torch's extra_repr, context managers'
__exit__ arguments, dataclass fields that are part of a record's schema (SWF columns, metrics), and the public
`load_registered_llm_policy` (docs/SCHEDULING.md; run in a subprocess by tests/e2e/test_scheduling_pipeline.py).
"""
# ruff: noqa
_.on_train_begin  # unused method (benchmarks/train_throughput.py:205)
_.on_step_end  # unused method (benchmarks/train_throughput.py:208)
control  # unused variable (benchmarks/train_throughput.py:135): transformers' TrainerCallback argument
qlora  # unused variable (frugaltune/config/training.py:124)
none  # unused variable (frugaltune/config/training.py:127)
prelayer  # unused variable (frugaltune/config/training.py:133): read as train.<method> (training/setup.py body_lr)
stage_timeout_s  # unused variable (frugaltune/config/release.py:50)
train_timeout_s  # unused variable (frugaltune/config/release.py:53)
_.initialize_parameters  # unused method (frugaltune/federated/secure.py:55)
client_manager  # unused variable (frugaltune/federated/secure.py:55)
_.configure_fit  # unused method (frugaltune/federated/secure.py:58)
client_manager  # unused variable (frugaltune/federated/secure.py:58)
server_round  # unused variable (frugaltune/federated/secure.py:58)
_.aggregate_fit  # unused method (frugaltune/federated/secure.py:61)
server_round  # unused variable (frugaltune/federated/secure.py:61)
_.configure_evaluate  # unused method (frugaltune/federated/secure.py:65)
client_manager  # unused variable (frugaltune/federated/secure.py:65)
server_round  # unused variable (frugaltune/federated/secure.py:65)
_.aggregate_evaluate  # unused method (frugaltune/federated/secure.py:68)
server_round  # unused variable (frugaltune/federated/secure.py:68)
server_round  # unused variable (frugaltune/federated/secure.py:71)
kv_heads  # unused variable (frugaltune/planner/memory.py:72)
eta_seconds  # unused variable (frugaltune/resolve.py:99)
predicted_peak_mb  # unused variable (frugaltune/resolve.py): read by name, recipes/train.py's getattr
load_registered_llm_policy  # unused function (frugaltune/scheduling/llm_policy.py:166)
max_bsld  # unused variable (frugaltune/scheduling/metrics.py:75)
allocated_procs  # unused variable (frugaltune/scheduling/swf.py): an SWF column
avg_cpu_time  # unused variable (frugaltune/scheduling/swf.py:62)
used_memory  # unused variable (frugaltune/scheduling/swf.py:63)
requested_memory  # unused variable (frugaltune/scheduling/swf.py:69)
user_id  # unused variable (frugaltune/scheduling/swf.py:71)
group_id  # unused variable (frugaltune/scheduling/swf.py:72)
executable_id  # unused variable (frugaltune/scheduling/swf.py:73)
queue_id  # unused variable (frugaltune/scheduling/swf.py:74)
partition_id  # unused variable (frugaltune/scheduling/swf.py:75)
preceding_job_id  # unused variable (frugaltune/scheduling/swf.py:76)
think_time  # unused variable (frugaltune/scheduling/swf.py:77)
_.load_context  # unused method (frugaltune/serving/pyfunc.py:54)
_.load_context  # unused method (frugaltune/serving/pyfunc.py:80)
exc_info  # unused variable (frugaltune/telemetry/steps.py:25)
exc_info  # unused variable (frugaltune/telemetry/sampler.py:136)
_.extra_repr  # unused method (frugaltune/training/fast.py:78)
_.use_cache  # unused attribute (frugaltune/training/methods.py:162)
_.mostly  # unused attribute (frugaltune/validation/suite.py:76)
_.notes  # unused attribute (frugaltune/validation/suite.py:86)
_.mostly  # unused attribute (frugaltune/validation/suite.py:142)
_.notes  # unused attribute (frugaltune/validation/suite.py:167)
_.notes  # unused attribute (frugaltune/validation/suite.py:171)
_.post_processor  # unused attribute (frugaltune/generation.py: the tokenizers library reads it when it encodes)
