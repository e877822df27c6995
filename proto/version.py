"""Protocol version. Peers with a different major version refuse each other."""

PROTOCOL_MAJOR = 1
# 1.1: BatchLayout.prefill_lens, NewRequest.client_req_id
# 1.2: StepStart (idle hand-over); model hooks (HookNeeds.model_states, StepBegin.want_states/model_hooks,
#      StepPlan.model_states, StepEnd.model_updates/model_outputs); HookNeeds.input_ids, BatchLayout.input_ids;
#      layer capture (HookNeeds.hidden_layers, StepEnd.hidden_layers)
# 1.3: AppendPayload / AppendReply (streaming payloads into running requests)
# 1.4: MirrorUpdate, StepStart.mirror_seq, SwitchReady.mirror_seq (appends reach the shim's state mirror)
# 1.5: StepTick, HookNeeds.step_layouts (a step that brings pass-through hooks nothing new sends a
#      fixed-size record, not a StepEnd)
# 1.6: StepBegin.packed and StepEnd.packed (PackedLayout: the layout's ints as packed u32 arrays, not
#      lists; StepBegin.batch optional)
# 1.7: StepPlan.stacks and row markers (ROW_MARKER): same-shaped tensors of a plan in one stacked
#      tensor each, their places in the trees naming a row of it
# 1.8: StepPlan.extra_kwargs / model_states as msgpack bytes whose tensors are extension values naming
#      StepPlan.stacks (proto/plan_trees.py): the shim's decoder places them, no tree walk
PROTOCOL_MINOR = 8
PACKED_LAYOUT_MINOR = 6  # from this minor on, a sidecar reads StepBegin.packed and StepEnd.packed
STACKED_ROWS_MINOR = 7  # from this minor on, a shim reads StepPlan.stacks and row markers
EXT_TREES_MINOR = 8  # from this minor on, a shim reads a plan's trees as bytes with tensor extensions
PROTOCOL_VERSION = f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
