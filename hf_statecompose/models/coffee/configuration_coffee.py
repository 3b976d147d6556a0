"""COFFEE configuration (model type ``coffee``).

COFFEE ("Context-Selective State Space Models: Feedback is All You Need", arXiv 2510.14027) is a diagonal
SSM whose step size is gated by its own previous state (eqs. (5), (7)); the mixer is
:class:`hf_statecompose.models.coffee.mixer.CoffeeMixer`. See ``modeling_coffee.py`` for the models.

This file imports nothing but transformers: it is also the config file that ``save_pretrained`` copies
next to the weights for ``trust_remote_code`` loading.
"""

from transformers.configuration_utils import PreTrainedConfig

MIXER_TYPES = ("coffee", "s6", "s6_linearized")
GATES = ("state", "input", "linear_state")
HEADS = ("lm", "core")


class CoffeeConfig(PreTrainedConfig):
    r"""
    Configuration of a COFFEE model: a language model (:class:`CoffeeForCausalLM`, heads ``"lm"`` and
    ``"core"``) or the MNIST classifier of the paper's App. I.2 (:class:`CoffeeForImageClassification`).

    The defaults are chosen so that small models need no other field: ``AutoConfig.for_model("coffee",
    vocab_size=64, hidden_size=48, num_hidden_layers=2)`` is valid.

    vocab_size (`int`, *optional*, defaults to 50280):
        Vocabulary size |M| (the GPT-NeoX tokenizer of the Mamba checkpoints).
    hidden_size (`int`, *optional*, defaults to 256):
        Width D of the residual stream (``"lm"``), or the embedding / SSM width (``"core"``).
    num_hidden_layers (`int`, *optional*):
        Number of blocks; defaults to 4 for ``head="lm"`` and must be 1 for ``head="core"`` (App. F: one SSM).
    state_size (`int`, *optional*, defaults to 8):
        n, the state size per feature (the paper's induction-head model: n = 8).
    expand (`int`, *optional*, defaults to 2):
        ``head="lm"``: ``intermediate_size = expand * hidden_size`` features run through the mixer.
    intermediate_size (`int`, *optional*):
        The mixer width of a ``"lm"`` block (default ``expand * hidden_size``); for ``"core"`` it is
        ``hidden_size`` (the mixer runs over the embeddings).
    mixer_type (`str`, *optional*, defaults to `"coffee"`):
        ``"coffee"`` (eq. (7)), or the baselines of the paper's experiments ``"s6"`` and ``"s6_linearized"``
        (``hf_statecompose.models.coffee.baselines``). States and composition need ``"coffee"``.
    gate (`str`, *optional*, defaults to `"state"`):
        The gate of the COFFEE mixer: ``"state"`` (eq. (5), state feedback), ``"input"`` (no feedback) or
        ``"linear_state"`` (linear feedback); the ablations of Table 6. States need ``"state"`` or ``"input"``.
    output_filter (`bool`, *optional*, defaults to `False`):
        The output filter of Remark 2 in the COFFEE mixer.
    head (`str`, *optional*, defaults to `"lm"`):
        ``"lm"``: pre-norm residual blocks with projections, a final norm and a tied LM head;
        ``"core"``: the paper's core module (App. F): embedding, one mixer, distances to the embeddings.
    layer_norm_epsilon (`float`, *optional*, defaults to 1e-5):
        Epsilon of the RMSNorms (``"lm"``).
    initializer_range (`float`, *optional*, defaults to 0.02):
        Std of the normal init of the embeddings and projections (``"lm"``).
    tie_word_embeddings (`bool`, *optional*, defaults to `True`):
        Whether the LM head shares the input embedding matrix (``"lm"``; ``"core"`` has no head weights).
    image_size (`int`, *optional*, defaults to 25):
        ``CoffeeForImageClassification``: images are ``image_size x image_size`` (App. I.2: 25, MNIST cropped).
    classifier_hidden_size (`int`, *optional*, defaults to 25):
        ``CoffeeForImageClassification``: the width between the two linear layers (App. I.2: 25).
    num_labels (`int`, *optional*, defaults to 10):
        ``CoffeeForImageClassification``: the classes (MNIST: 10).
    """

    model_type = "coffee"

    vocab_size: int = 50280
    hidden_size: int = 256
    num_hidden_layers: int | None = None
    state_size: int = 8
    expand: int = 2
    intermediate_size: int | None = None
    mixer_type: str = "coffee"
    gate: str = "state"
    output_filter: bool = False
    head: str = "lm"
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    pad_token_id: int | None = 0
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
    use_cache: bool = True
    tie_word_embeddings: bool = True
    image_size: int = 25
    classifier_hidden_size: int = 25

    def __post_init__(self, **kwargs):
        if self.num_hidden_layers is None:
            self.num_hidden_layers = 1 if self.head == "core" else 4
        if self.intermediate_size is None and isinstance(self.expand, int) and isinstance(self.hidden_size, int):
            self.intermediate_size = int(self.expand * self.hidden_size)
        if getattr(self, "id2label", None) is None:
            kwargs.setdefault("num_labels", 10)
        self._validate_coffee()
        super().__post_init__(**kwargs)

    def _validate_coffee(self) -> None:
        for name, allowed in (("mixer_type", MIXER_TYPES), ("gate", GATES), ("head", HEADS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "state_size",
            "expand",
            "intermediate_size",
            "image_size",
            "classifier_hidden_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.head == "core" and self.num_hidden_layers != 1:
            raise ValueError(
                f"num_hidden_layers must be 1 for head='core' (the paper's core module has one SSM layer, App. F), "
                f"got {self.num_hidden_layers}"
            )
        if not isinstance(self.output_filter, bool):
            raise ValueError(f"output_filter must be a bool, got {self.output_filter!r}")
        if not (isinstance(self.layer_norm_epsilon, (int, float)) and self.layer_norm_epsilon > 0):
            raise ValueError(f"layer_norm_epsilon must be a positive number, got {self.layer_norm_epsilon!r}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def mixer_size(self) -> int:
        """E, the features each layer's mixer runs over: ``intermediate_size`` (``"lm"``), ``hidden_size`` (``"core"``)."""
        return self.hidden_size if self.head == "core" else self.intermediate_size  # type: ignore[return-value]  # set in __post_init__

    @property
    def layer_types(self):
        # what transformers' DynamicCache builds its layers from: one recurrent (linear attention) layer per block
        return ["linear_attention"] * self.num_hidden_layers


CoffeeConfig.register_for_auto_class()

__all__ = ["CoffeeConfig"]
