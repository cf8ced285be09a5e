"""What a model family decides, in one place: the seam between an architecture and the strategies.

A strategy never branches on a model type. It asks the `Family` of the run's model config, which is derived from the
model itself — transformers' own class for the config (AutoModelForCausalLM's mapping), its module tree, and the
tensor-parallel plan transformers ships with the config (`base_model_tp_plan`), whose styles say which linear layers
read the residual stream (colwise) and which write back to it (rowwise), and which replicated parameters get partial
gradients under TP (`replicated_with_grad_allreduce`). What the plan leaves implicit is read off the modules' shapes:

- a fused projection is one linear layer whose output holds several parts — Phi3's qkv_proj (q, k and v heads:
  (H + 2·KV)·head_dim rows) and gate_up_proj (gate and up: 2·intermediate rows);
- a per-head norm (Qwen3, Gemma3: q_norm/k_norm over head_dim) has replicated weights whose gradient each TP rank
  computes from its own heads only; the dim its input holds the heads in is found by running the layer once
  (`_probe`: Qwen3 normalises (batch, seq, heads, head_dim), Gemma3 (batch, heads, seq, head_dim));
- a full-width norm (OLMo2: q_norm over all H·head_dim of q_proj's output) cannot run on a head-sharded projection
  by itself: its mean is over the whole width;
- the norms on the residual stream are the decoder layer's own norm children (2 in Llama, 4 in Gemma3, OLMo2's two
  post-norms and no pre-norm).

A mixture-of-experts family's sparse block is read off transformers' expert-parallel plan (`base_model_ep_plan`: the
experts module it dispatches tokens to, `ep_dispatch_experts`, and their fused 3-D weights, `grouped_gemm`), its TP
plan (how those weights split within an expert: gate_up_proj packs gate and up, `packed_colwise`) and the block's
children: the router is the child whose weight is [experts, hidden], any other child with parameters a shared expert.
The load-balancing loss's coefficient is the config's router_aux_loss_coef when transformers' own forward would add it
(output_router_logits); a config mapped from another framework's model may say its router losses are that
framework's (router_aux_loss_scope, router_z_loss_coef: megatron-core's, per layer and micro-batch). docs/moe.md.

Each strategy turns this description into its own parallelism (fsdp_strategy.py a torch-native plan of the
harness's, autotp_strategy.py DeepSpeed's AutoTP where it can shard the family, the pipeline a stage split of the
decoder stack, transformers_strategy.py transformers' own plan), so the two TP implementations check each other.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field

from parity.errors import ConfigError

COLWISE_STYLES = ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise")
ROWWISE_STYLES = ("rowwise", "rowwise_split_input", "rowwise_rep", "packed_rowwise")
PARTIAL_GRAD_STYLES = ("replicated_with_grad_allreduce",)


@dataclass(frozen=True)
class Projection:
    """A linear layer of a decoder layer that reads the residual stream (`parts`: the widths of what its output holds,
    in order — one part for a plain projection, several for a fused one)."""

    name: str  # relative to the decoder layer, e.g. "self_attn.q_proj"
    parts: tuple[int, ...]

    @property
    def fused(self) -> bool:
        return len(self.parts) > 1


@dataclass(frozen=True)
class MoE:
    """The sparse block of a mixture-of-experts family (names relative to a decoder layer). The router returns (logits
    [tokens, experts], routing weights [tokens, top_k], expert ids [tokens, top_k]); the experts module is called as
    experts(hidden [tokens, hidden], expert ids, routing weights) and holds each weight of every expert in one 3-D
    parameter [experts, out, in]."""

    block: str  # "mlp"
    router: str  # "mlp.gate"
    experts: str  # "mlp.experts"
    expert_weights: dict[str, tuple[int, int]]  # fused 3-D weight → (the dim a TP split of one expert cuts, its parts)
    shared_experts: tuple[str, ...]  # "mlp.shared_experts": dense MLPs beside the routed experts, run on every token
    layers: tuple[int, ...]  # the decoder layers whose block is sparse
    num_experts: int
    top_k: int
    aux_loss_coef: float  # the load-balancing loss's weight in the training loss; 0.0: not in it
    aux_loss_scope: str = "global"  # "global": over the global batch, layers pooled (transformers' loss); or
    # "megatron-core": megatron-core's, each sparse layer's and micro-batch's own (parity/training/routing.py)
    z_loss_coef: float = 0.0  # the router z loss's weight (megatron-core's, per layer and micro-batch); 0.0: none

    def check_ep(self, ep_size: int) -> None:
        """ConfigError when `ep_size` does not divide the experts."""
        if self.num_experts % ep_size:
            fits = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise ConfigError(f"--ep_size {ep_size} does not divide the model's {self.num_experts} experts: use an "
                              f"--ep_size in {fits}")


@dataclass(frozen=True)
class Family:
    """One architecture's decoder layer, as every strategy needs it (names relative to a decoder layer)."""

    model_type: str
    causal_lm: str  # transformers' class name, e.g. "Qwen3ForCausalLM"
    tied: bool  # lm_head is the embedding's weight
    num_layers: int
    layer_types: tuple[str, ...]  # per layer: "full_attention", "sliding_attention", ...
    embedding: str  # the input embedding ("model.embed_tokens"), what the first pipeline stage runs before its layers
    stack: str  # the decoder layers' ModuleList ("model.layers")
    final: tuple[str, ...]  # what runs after the stack, in order ("model.norm", "lm_head"): the last stage's
    outside: tuple[str, ...] = ()  # modules with parameters in none of those (Gemma 4's per-layer input embeddings)
    pipeline_plan: bool = True  # whether transformers' pipeline plan names them (else read off the modules)
    attention: str | None = None  # the attention module ("self_attn")
    mlp: str | None = None  # the MLP module ("mlp")
    attention_in: tuple[Projection, ...] = ()  # q, k, v — or one fused qkv
    attention_out: str | None = None  # o_proj
    mlp_in: tuple[Projection, ...] = ()  # gate, up — or one fused gate_up
    mlp_act: str | None = None  # the activation module, applied to gate's output
    mlp_out: str | None = None  # down_proj
    head_norms: dict[str, int] = field(default_factory=dict)  # per-head norm → the dim of its input that holds heads
    width_norms: dict[str, str] = field(default_factory=dict)  # full-width norm → the projection whose output it normalises
    layer_norms: tuple[str, ...] = ()  # norms on the residual stream, in the layer's order
    why_no_tp: str | None = None  # why the layers cannot be described for TP (None: they can)
    moe: MoE | None = None  # the sparse block of a mixture-of-experts family (None: a dense model)

    def check_tp(self, tp_size: int, who: str) -> None:
        """ConfigError when `who` (a strategy) cannot shard this family at `tp_size`."""
        if tp_size > 1 and self.why_no_tp:
            raise ConfigError(f"{who} cannot tensor-parallelise a '{self.model_type}' model ({self.why_no_tp}): use "
                              f"--tp_size 1, or train_ddp.py / train_pipeline.py")


def causal_lm_class(config):
    """transformers' causal-LM class for `config`; ConfigError when transformers has none (not a decoder-only LM)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"a '{config.model_type}' model is an encoder-decoder: the harness trains decoder-only causal "
                          f"language models (e.g. llama, qwen3, gemma3_text, mistral, olmo2, phi3)")
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ConfigError(f"a '{config.model_type}' model has no causal-LM class in transformers "
                          f"(AutoModelForCausalLM does not take it): the harness trains decoder-only causal language "
                          f"models") from None


def kv_heads(config) -> int:
    """The key/value heads of a model's attention: num_key_value_heads (grouped-query attention); Falcon's one of
    multi_query outside its new decoder architecture, else its num_kv_heads; else one per attention head — what GPT-2,
    GPT-NeoX, OPT and Bloom configs leave unnamed."""
    if getattr(config, "num_key_value_heads", None):
        return int(config.num_key_value_heads)
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1
    return int(getattr(config, "num_kv_heads", None) or config.num_attention_heads)


def hf_config(module):
    """`module`'s Hugging Face config (a transformers model's: one it can save as JSON), or None — a module of one's own
    may hold a `config` of another kind, or none."""
    config = getattr(module, "config", None)
    return config if hasattr(config, "to_json_string") else None


def text_config(config):
    """The config of the language model itself (a multimodal config's text part; else the config)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def language_model(config):
    """What the strategies train of a multimodal config (Gemma 3 4B's, Qwen3.5's, Mistral 3's): its language model — the
    text config, where transformers has a causal LM of it. The harness trains on text, where the vision tower takes no
    part. Else the config itself."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        text = text_config(config)
    except ValueError:  # several text configs (an encoder's and a decoder's): causal_lm_class judges the whole
        return config
    return text if text is not config and type(text) in MODEL_FOR_CAUSAL_LM_MAPPING else config


def multimodal_refusal(config) -> str | None:
    """Why a multimodal model read whole is not recorded or replayed (None for a language model): the replay trains
    its language model alone (language_model), whose weights and norms are not the whole model's. The recorder reads a
    whole one on every rank as its language model (parity/views/language_model.py): a sharded one, or a record of one
    made before, gets this line."""
    text = language_model(config)
    if text is config:
        return None
    return (f"a multimodal '{config.model_type}' model read whole (its other towers' weights and norms beside its "
            f"language model's), where the replay trains the language model alone: the recorder reads the language "
            f"model alone where the model is whole on every rank (plain PyTorch or DDP); or record a run of its "
            f"language model ({causal_lm_class(text).__name__}, "
            f"AutoModelForCausalLM.from_config(config.get_text_config()))")


def family_of(config) -> Family:
    """The Family of a model config (cached by its JSON)."""
    return _family(json.dumps(config.to_dict(), sort_keys=True, default=str), type(config))


@functools.lru_cache(maxsize=32)
def _family(config_json: str, config_class) -> Family:
    import torch

    config = config_class.from_dict(json.loads(config_json))
    cls = causal_lm_class(config)
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:  # a config its own class refuses (a pad_token_id outside the vocabulary ...)
        raise ConfigError(f"transformers cannot build a '{config.model_type}' model from this config ("
                          f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}): fix its "
                          f"config.json") from None
    text = text_config(config)
    try:
        types = tuple(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
        common = dict(model_type=config.model_type, causal_lm=cls.__name__, tied=bool(text.tie_word_embeddings),
                      num_layers=text.num_hidden_layers, layer_types=types, **_stack_parts(model))
        layers = model.get_submodule(common["stack"])
        common["moe"] = _moe_roles(model, text, layers)
    except (AttributeError, TypeError, KeyError) as exc:  # a stack unlike a decoder-only LM's (BLT's, HRM's ...)
        raise ConfigError(f"the harness cannot read the decoder stack of {cls.__name__} ({type(exc).__name__}: "
                          f"{(str(exc).strip().splitlines() or [''])[0][:120]}): it trains decoder-only causal "
                          f"language models whose layers form one stack (e.g. llama, qwen3, gemma3_text, mistral)") \
            from None
    try:
        return Family(**common, **_layer_roles(model, text, layers, common["moe"]))
    except _Undescribed as exc:
        return Family(**common, why_no_tp=str(exc))
    except Exception as exc:  # a config the seam cannot read (Gemma 4's per-layer head_dim): no TP of it, not a crash
        return Family(**common, why_no_tp=f"its layers cannot be described ({type(exc).__name__}: "
                                          f"{(str(exc).strip().splitlines() or [''])[0][:120]})")


def _moe_roles(model, text, layers) -> MoE | None:
    """The sparse block, from transformers' expert-parallel and TP plans and the block's children; None for a model
    without an expert-parallel plan (a dense model)."""
    ep_plan = {key.split("layers.*.", 1)[1]: style for key, style in (getattr(model, "ep_plan", None) or {}).items()
               if "layers.*." in key}  # (transformers before 5.21 has no ep_plan)
    experts = next((name for name, style in ep_plan.items() if style == "ep_dispatch_experts"), None)
    if experts is None:
        return None
    sparse = tuple(i for i, layer in enumerate(layers) if experts in dict(layer.named_modules()))
    if not sparse:
        return None
    layer = layers[sparse[0]]
    module = layer.get_submodule(experts)
    block = experts.rsplit(".", 1)[0]
    tp_plan = {key.split("layers.*.", 1)[1]: style for key, style in (model.tp_plan or {}).items() if "layers.*." in key}
    transposed = bool(getattr(module, "is_transposed", False))
    weights = {}
    for name, param in module.named_parameters(recurse=False):
        style = tp_plan.get(f"{experts}.{name}", "")
        reads = style in COLWISE_STYLES  # cuts the output dim; rowwise styles cut the input dim
        dim = (2 if transposed else 1) if reads else (1 if transposed else 2)
        weights[name] = (dim, 2 if style.startswith("packed") else 1)
    num_experts = next(iter(module.parameters())).shape[0]
    children = [(name, child) for name, child in layer.get_submodule(block).named_children() if name != "experts"
                and list(child.parameters())]
    router = next((name for name, child in children
                   if any(tuple(p.shape) == (num_experts, text.hidden_size) for p in child.parameters(recurse=False))),
                  None)
    if router is None:
        return None
    top_k = getattr(layer.get_submodule(f"{block}.{router}"), "top_k", None) or text.num_experts_per_tok
    if not top_k:
        raise ConfigError(f"the '{text.model_type}' config names no num_experts_per_tok (the experts each token is "
                          f"routed to): fix its config.json")
    coef = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0) if getattr(text, "output_router_logits", False) \
        else 0.0
    return MoE(block=block, router=f"{block}.{router}", experts=experts, expert_weights=weights,
               shared_experts=tuple(f"{block}.{name}" for name, _ in children if name != router), layers=sparse,
               num_experts=int(num_experts), top_k=int(top_k), aux_loss_coef=coef,
               aux_loss_scope=getattr(text, "router_aux_loss_scope", "global"),
               z_loss_coef=float(getattr(text, "router_z_loss_coef", 0.0) or 0.0))


def _stack_parts(model) -> dict:
    """Where the decoder stack sits, and what runs before and after it — from transformers' pipeline plan (each
    entry's inputs and outputs: the module taking input_ids is the embedding, the ModuleList the stack, the rest runs
    after it), in the stock forward's order. A class without one (GPT-2, OPT, Bloom, Falcon, OLMoE) is read off its
    modules (`_read_parts`); the pipeline, which runs the stages as the plan lays them out, refuses it
    (`pipeline_plan`)."""
    import torch

    plan = getattr(model, "pp_plan", None) or {}
    stack = next((name for name in plan if isinstance(model.get_submodule(name), torch.nn.ModuleList)), None)
    embedding = next((name for name, (inputs, _) in plan.items() if list(inputs) == ["input_ids"]), None)
    if stack is None or embedding is None:
        embedding, stack, final = _read_parts(model)
        planned = False
    else:
        final = [name for name in plan if name not in (stack, embedding)]
        final.sort(key=lambda name: name.startswith(model.base_model_prefix + "."), reverse=True)  # the base model's first
        planned = True
    parts = (embedding, stack, *final)
    outside = set()
    for name, _ in model.named_parameters():
        if not any(name.startswith(part + ".") for part in parts):  # its highest module holding no part
            path = name.split(".")
            outside.add(next(".".join(path[:i]) for i in range(1, len(path) + 1)
                             if not any((part + ".").startswith(".".join(path[:i]) + ".") for part in parts)))
    return {"embedding": embedding, "stack": stack, "final": tuple(final), "outside": tuple(sorted(outside)),
            "pipeline_plan": planned}


def _read_parts(model) -> tuple[str, str, list[str]]:
    """(embedding, stack, final) of a class without a pipeline plan, read off its modules: the input embedding
    (get_input_embeddings), the one ModuleList as long as the config's layers, the base model's children registered
    after it that hold parameters (the final norm) and the output embedding (lm_head). ConfigError where they are not
    so found."""
    import torch

    names = {id(m): n for n, m in model.named_modules()}
    text = text_config(model.config)
    layers = text.num_hidden_layers
    stacks = [n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    attends = len(stacks) == 1 and getattr(text, "num_attention_heads", None) and any(
        "Attention" in type(m).__name__ for m in model.get_submodule(stacks[0]).modules())
    if not attends or id(embedding) not in names or head is None or id(head) not in names:
        raise ConfigError(f"{type(model).__name__} has no pipeline plan naming its embedding and decoder stack "
                          f"(base_model_pp_plan), and its modules do not show them (one list of its {layers} layers "
                          f"with attention heads, an input and an output embedding): the harness cannot find its "
                          f"decoder layers; it trains causal language models whose attention layers form one stack "
                          f"(e.g. llama, qwen3, gemma3_text, mistral, gpt2)")
    stack = stacks[0]
    parent, _, leaf = stack.rpartition(".")
    children = list(model.get_submodule(parent).named_children()) if parent else list(model.named_children())
    after = [f"{parent}.{n}" if parent else n for n, m in children[[n for n, _ in children].index(leaf) + 1:]
             if list(m.parameters())]
    return names[id(embedding)], stack, [*after, names[id(head)]]


class _Undescribed(Exception):
    """The decoder layer does not fit the seam's description (a family the harness's TP plans cannot cover)."""


def _layer_roles(model, text, layers, moe: MoE | None) -> dict:
    """The decoder layers' roles, from transformers' TP plan (relative to a layer) and the modules' shapes. A rule
    naming a module no layer has (a dense MLP's, where every layer is sparse) is passed over; the experts and any
    shared experts are the sparse block's (`moe`), not the dense roles' — under TP they stay whole, each TP rank
    running them on its share of the tokens (the harness's plans) or split by transformers' own plan."""
    import torch

    plan = {key.split("layers.*.", 1)[1]: style for key, style in (model.tp_plan or {}).items() if "layers.*." in key}
    if not plan:
        raise _Undescribed(f"transformers ships no tensor-parallel plan for {type(model).__name__}")
    modules = {}
    for each in layers:
        for name, module in each.named_modules():
            modules.setdefault(name, module)
    layer = layers[0]
    if moe:
        sparse_parts = (moe.experts, *moe.shared_experts)
        plan = {name: style for name, style in plan.items()
                if not any(name == part or name.startswith(part + ".") for part in sparse_parts)}
    plan = {name: style for name, style in plan.items() if name in modules}
    dense_mlp = not moe or len(moe.layers) < len(layers)
    heads, kv = text.num_attention_heads, kv_heads(text)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    attention = next((n for n, m in layer.named_children() if "Attention" in type(m).__name__), None)
    mlp = moe.block if moe else next((n for n, m in layer.named_children() if "MLP" in type(m).__name__), None)
    if attention is None or mlp is None:
        raise _Undescribed(f"{type(layer).__name__} has no attention or MLP child module")
    roles: dict = {"attention": attention, "mlp": mlp, "attention_in": [], "mlp_in": [], "head_norms": {},
                   "width_norms": {}}
    for name, style in plan.items():
        module = modules.get(name)
        if module is None:
            raise _Undescribed(f"its TP plan names {name}, which the layer does not have")
        where = "attention" if name.startswith(attention + ".") else "mlp" if name.startswith(mlp + ".") else None
        if style in PARTIAL_GRAD_STYLES:
            roles["head_norms"][name] = -1  # its heads dim, probed below
        elif style in COLWISE_STYLES and isinstance(module, torch.nn.Linear) and where:
            out = module.out_features
            parts = ((heads * head_dim, kv * head_dim, kv * head_dim) if where == "attention" and
                     out == (heads + 2 * kv) * head_dim and "qkv" in name else
                     (out // 2, out // 2) if where == "mlp" and out == 2 * text.intermediate_size else (out,))
            roles[f"{where}_in"].append(Projection(name, parts))
        elif style in ROWWISE_STYLES and isinstance(module, torch.nn.Linear) and where:
            roles[f"{where}_out"] = name
        else:
            raise _Undescribed(f"its TP plan's style '{style}' for {name} is not one the harness can follow")
    if not roles["attention_in"] or "attention_out" not in roles:
        raise _Undescribed("its TP plan does not name the attention's input and output projections")
    if dense_mlp and (not roles["mlp_in"] or "mlp_out" not in roles):
        raise _Undescribed("its TP plan does not name the MLP's input and output projections")
    inputs = {p.name.rsplit(".", 1)[-1][0]: p for p in roles["attention_in"]}  # q_proj → "q"
    for name, module in modules.items():
        if name.startswith(attention + ".") and "Norm" in type(module).__name__ and name not in roles["head_norms"]:
            width = sum(p.numel() for p in module.parameters())
            target = inputs.get(name.rsplit(".", 1)[-1][0])  # q_norm → q_proj
            if target is None or target.fused or target.parts[0] != width:
                raise _Undescribed(f"its attention norm {name} (width {width}) matches no projection")
            roles["width_norms"][name] = target.name
    acts = [n for n, m in modules.items() if n.startswith(mlp + ".") and n.count(".") == 1 and
            not list(m.parameters()) and not isinstance(m, torch.nn.Dropout)]
    if dense_mlp and len(acts) != 1:
        raise _Undescribed(f"its MLP has {len(acts)} activation modules, not one")
    roles["mlp_act"] = acts[0] if dense_mlp else None
    roles["layer_norms"] = tuple(n for n, m in layer.named_children() if "Norm" in type(m).__name__)
    if roles["head_norms"]:
        roles["head_norms"] = _probe_head_dims(model, text, list(roles["head_norms"]), heads, kv)
    roles["attention_in"], roles["mlp_in"] = tuple(roles["attention_in"]), tuple(roles["mlp_in"])
    return roles


def _probe_head_dims(model, text, norms: list[str], heads: int, kv: int) -> dict[str, int]:
    """The dim of each per-head norm's input that holds the heads: one forward of a one-layer copy of the model on
    a (1, 5) input, with hooks on the norms (a meta-device forward cannot build the attention mask)."""
    import torch

    small = copy.deepcopy(text)
    small.num_hidden_layers, small.vocab_size = 1, 8
    for width in ("intermediate_size", "moe_intermediate_size"):  # the MLP's (and the experts') width: not probed
        if isinstance(getattr(small, width, None), int):
            setattr(small, width, 8)
    if getattr(small, "layer_types", None):
        small.layer_types = small.layer_types[:1]
    probe = causal_lm_class(small)(small).eval()  # the language model's own class (a multimodal model's text part)
    layer, seen = getattr(probe, probe.base_model_prefix).layers[0], {}

    def record(name):
        def hook(module, args):
            seen.setdefault(name, args[0].shape)
        return hook

    hooks = [layer.get_submodule(n).register_forward_pre_hook(record(n)) for n in norms]
    with torch.no_grad():
        probe(input_ids=torch.zeros(1, 5, dtype=torch.long), use_cache=False)
    for h in hooks:
        h.remove()
    dims = {}
    for name, shape in seen.items():
        found = [d for d in range(1, len(shape) - 1) if shape[d] in (heads, kv) and shape[d] != 5]
        if len(found) != 1:
            raise _Undescribed(f"cannot tell which dim of {name}'s input {tuple(shape)} holds the heads")
        dims[name] = found[0]
    return dims


# ---------------------------------------------------------------------------------------------------------------
# Configs: from a published dict, and cut to fewer layers
# ---------------------------------------------------------------------------------------------------------------

def config_from_dict(data: dict):
    """A transformers config from a config.json dict (its `model_type` picks the class)."""
    from transformers import AutoConfig

    data = dict(data)
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ConfigError("the model config has no model_type: give a Hugging Face config.json")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError:
        raise ConfigError(f"model_type '{model_type}' is not a model transformers knows (transformers "
                          f"{transformers_version()}): upgrade transformers, or use another model") from None


def with_num_layers(config, num_layers: int):
    """The config with `num_layers` decoder layers. Every per-layer list (Gemma3's and Qwen's layer_types, Llama4's
    no_rope_layers, and any other list as long as the stack) is cut to the layers kept — the first num_layers layers of
    the real model — or, when the stack grows, derived again by the config class (from sliding_window_pattern,
    max_window_layers ...) or else repeated; a list of layer indices (`*_layers`: Qwen-MoE's mlp_only_layers, Llama4's
    moe_layers) keeps the indices of the layers kept; a count of layers such as max_window_layers is capped at the new
    depth; a dict keyed by layer index (Gemma 4's per_layer_config: a full-attention layer's own head_dim) keeps the
    entries of the layers kept, or repeats them as the lists are. What is set as a frequency (decoder_sparse_step,
    interleave_moe_layer_step, first_k_dense_replace, sliding_window_pattern) holds for the layers kept as it is."""
    old = config.num_hidden_layers
    given, data = config.to_dict(), config.to_dict()
    indices = [k for k, v in data.items() if k.endswith("_layers") and isinstance(v, list)
               and all(isinstance(i, int) and not isinstance(i, bool) for i in v)]
    per_layer = [k for k, v in data.items() if isinstance(v, list) and len(v) == old and old > 1 and k not in indices]
    by_index = {k: data.pop(k) for k, v in list(data.items())
                if isinstance(v, dict) and v and all(str(i).isdigit() for i in v)}
    data["num_hidden_layers"] = num_layers
    if "max_window_layers" in data and isinstance(data["max_window_layers"], int):
        data["max_window_layers"] = min(data["max_window_layers"], num_layers)
    if num_layers <= old:
        for key in per_layer:
            data[key] = data[key][:num_layers]
        for key in indices:
            data[key] = [i for i in data[key] if i < num_layers]
    else:
        derived = type(config).from_dict({k: v for k, v in data.items() if k not in per_layer})
        data = derived.to_dict()
        for key in per_layer:
            if not (isinstance(data.get(key), list) and len(data[key]) == num_layers):
                data[key] = [given[key][i % old] for i in range(num_layers)]
    if not by_index:
        return type(config).from_dict(data)
    types = getattr(type(config).from_dict(data), "layer_types", None)  # as the config class settles them
    for key, entries in by_index.items():
        data[key] = _layer_entries(entries, data_types=given.get("layer_types"), old=old, types=types,
                                   num_layers=num_layers)
    return type(config).from_dict(data)


def _layer_entries(entries: dict, *, data_types, old: int, types, num_layers: int) -> dict:
    """A dict keyed by layer index for the new depth: where its entries follow the layers' types (each type's layers
    sharing one entry, or none: Gemma 4's full-attention head_dim), each kept layer takes its type's — the config class
    may settle a cut stack's types anew (Gemma 4's last layer always full attention); else the entries of the layers
    kept, repeated as the lists are. Keys written as given (5, or "05")."""
    first = next(iter(entries))
    key = (lambda i: str(i).zfill(len(first))) if isinstance(first, str) else int
    at = {int(i): v for i, v in entries.items()}
    if isinstance(data_types, list) and len(data_types) == old and isinstance(types, list):
        seen: dict = {}
        for i, kind in enumerate(data_types):
            seen.setdefault(kind, set()).add(json.dumps(at.get(i), sort_keys=True))
        if all(len(each) == 1 for each in seen.values()):
            of_type = {kind: json.loads(next(iter(each))) for kind, each in seen.items()}
            return {key(i): of_type[kind] for i, kind in enumerate(types) if of_type.get(kind) is not None}
    return {key(i): at[i % old] for i in range(num_layers) if i % old in at}


def cut_in_place(config, num_layers: int) -> int | None:
    """A causal LM's config object cut in place to its first `num_layers` decoder layers, as with_num_layers cuts a
    copy (verify_trainer.py --num_layers: the config the user's code holds is the one its model is built from). Only
    the language model's depth: a multimodal config's text part is cut, its vision tower's config keeps its depth, and
    a config transformers builds no causal LM from (a vision encoder's) is left alone. Returns the layers it had; None
    where nothing was cut (not such a config, or not deeper than `num_layers`)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    text = text_config(config)
    old = getattr(text, "num_hidden_layers", None)
    if not isinstance(old, int) or old <= num_layers:
        return None
    before, after = text.to_dict(), with_num_layers(text, num_layers).to_dict()
    for key, value in after.items():
        if key in before and before[key] != value:
            setattr(text, key, value)
    return old


def transformers_version() -> str:
    import transformers

    return transformers.__version__
