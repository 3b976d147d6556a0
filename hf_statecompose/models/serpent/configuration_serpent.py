"""SeRpEnt-Mamba configuration (model type ``serpent_mamba``).

SeRpEnt ("Selective Resampling for Expressive State Space Models", arXiv 2501.11729) compresses each
layer's input at several rates κ_b (one branch per rate), runs a Mamba selective SSM per branch on the
compressed sequence and decompresses the outputs. See ``modeling_serpent.py`` for the equations.

This file imports nothing but transformers: it is also the config file that ``save_pretrained`` copies
next to the weights for ``trust_remote_code`` loading.
"""

import math

from transformers.configuration_utils import PreTrainedConfig


class SeRpEntMambaConfig(PreTrainedConfig):
    r"""
    Configuration of a SeRpEnt model whose branch SSMs are Mamba-1 selective SSMs.

    The defaults follow App. B.2 of the paper (language modeling) where it says something, and are chosen
    so that small models need no other field: ``AutoConfig.for_model("serpent_mamba", vocab_size=64,
    hidden_size=48, num_hidden_layers=2)`` is valid (48 and 96 are divisible by the 3 branches).

    vocab_size (`int`, *optional*, defaults to 50280):
        Vocabulary size (the GPT-NeoX tokenizer of the Mamba checkpoints; the paper trains its own 30k BPE).
    hidden_size (`int`, *optional*, defaults to 768):
        Width H of the residual stream. Branch b reads all H features and writes ``H / num_branches`` of
        them (eq. 15b concatenates the branch outputs), so H must be divisible by the number of branches.
    num_hidden_layers (`int`, *optional*, defaults to 8):
        Number of SeRpEnt blocks (App. B.2: depth 8).
    state_size (`int`, *optional*, defaults to 16):
        SSM state size N of every branch's Mamba SSM (the Mamba default).
    expand (`int`, *optional*, defaults to 2):
        Expansion factor of the Mamba SSMs: ``intermediate_size = expand * hidden_size`` unless set.
    intermediate_size (`int`, *optional*):
        Total inner width I of the branch SSMs, split evenly: branch b has ``I / num_branches`` channels
        (App. B.2: 510 = 3 x 170). Must be divisible by the number of branches.
    conv_kernel (`int`, *optional*, defaults to 4):
        Kernel size of the causal conv inside each branch SSM.
    branch_compressions (`tuple[float]`, *optional*, defaults to `(1.0, 0.5, 0.1)`):
        The minimum compression rate κ_b of each branch, each in (0, 1]. κ = 1 is the uncompressed "base"
        branch (a Mamba over the tokens); at most one branch may have κ = 1 (App. B.2 uses 1.0, 0.5, 0.1).
    num_gaussians (`int`, *optional*, defaults to 8):
        G, the number of learnable Gaussian means of the distance expansion ε (eq. 12b; App. B.2: 8).
    resample_window (`int`, *optional*, defaults to 5):
        K, the number of nearest input elements each resampled element is interpolated from (eq. 12a).
        The paper gives K only for Long Range Arena (Table 3: 5 to 7); 5 is the value of its only
        three-branch configuration, and the cheapest (θ_Γ reads K·(H+G) features).
    time_step_rank (`int` or `"auto"`, *optional*, defaults to `"auto"`):
        Rank of the branch SSMs' Δ projection; ``"auto"`` is ``ceil(branch_width / 16)`` per branch.
    layer_norm_epsilon (`float`, *optional*, defaults to 1e-5):
        Epsilon of the RMSNorms (App. B.2: an RMSNorm before every SeRpEnt block, and one at the end).
    use_bias, use_conv_bias, hidden_act, initializer_range, time_step_scale, time_step_min, time_step_max,
    time_step_init_scheme, time_step_floor, rescale_prenorm_residual:
        As in `MambaConfig`, for the branch SSMs.
    residual_in_fp32 (`bool`, *optional*, defaults to `True`):
        Whether the residual stream is added in float32 (as in Mamba).
    tie_word_embeddings (`bool`, *optional*, defaults to `True`):
        Whether the LM head shares the input embedding matrix.
    """

    model_type = "serpent_mamba"

    vocab_size: int = 50280
    hidden_size: int = 768
    num_hidden_layers: int = 8
    state_size: int = 16
    expand: int = 2
    intermediate_size: int | None = None
    conv_kernel: int = 4
    branch_compressions: list | tuple = (1.0, 0.5, 0.1)
    num_gaussians: int = 8
    resample_window: int = 5
    time_step_rank: str | int = "auto"
    layer_norm_epsilon: float = 1e-5
    pad_token_id: int | None = 0
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    initializer_range: float = 0.1
    residual_in_fp32: bool = True
    time_step_scale: float = 1.0
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_init_scheme: str = "random"
    time_step_floor: float = 1e-4
    rescale_prenorm_residual: bool = False
    use_cache: bool = True
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs):
        self.branch_compressions = tuple(float(k) for k in self.branch_compressions)
        if self.intermediate_size is None:
            self.intermediate_size = int(self.expand * self.hidden_size)
        self._validate_serpent()
        super().__post_init__(**kwargs)

    def _validate_serpent(self) -> None:
        compressions = self.branch_compressions
        if not compressions:
            raise ValueError("branch_compressions must list at least one compression rate κ in (0, 1]")
        for kappa in compressions:
            if not (0.0 < kappa <= 1.0) or math.isnan(kappa):
                raise ValueError(f"branch_compressions: every κ must be in (0, 1], got {list(compressions)}")
        if sum(kappa == 1.0 for kappa in compressions) > 1:
            raise ValueError(
                f"branch_compressions: at most one branch may be uncompressed (κ = 1), got {list(compressions)}"
            )
        branches = len(compressions)
        for name in ("hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if value < branches or value % branches:
                raise ValueError(
                    f"{name} ({value}) must be a positive multiple of the number of branches ({branches}, "
                    "one per entry of branch_compressions): each branch gets an equal share"
                )
        for name, symbol in (
            ("num_gaussians", "G"),
            ("resample_window", "K"),
            ("state_size", "N"),
            ("conv_kernel", "the conv width"),
            ("num_hidden_layers", "the depth"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({symbol}) must be an integer >= 1, got {value!r}")
        if self.time_step_rank != "auto" and (not isinstance(self.time_step_rank, int) or self.time_step_rank < 1):
            raise ValueError(f"time_step_rank must be 'auto' or an integer >= 1, got {self.time_step_rank!r}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def num_branches(self) -> int:
        return len(self.branch_compressions)

    @property
    def branch_hidden_size(self) -> int:
        """h_b: the features each branch writes (and its SSM's model width)."""
        return self.hidden_size // self.num_branches

    @property
    def branch_intermediate_size(self) -> int:
        """i_b: the channels of each branch's SSM."""
        return self.intermediate_size // self.num_branches  # type: ignore[operator]  # set in __post_init__

    @property
    def branch_time_step_rank(self) -> int:
        if self.time_step_rank == "auto":
            return max(1, math.ceil(self.branch_hidden_size / 16))
        return int(self.time_step_rank)


SeRpEntMambaConfig.register_for_auto_class()

__all__ = ["SeRpEntMambaConfig"]
