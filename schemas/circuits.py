"""POST /v1/circuits: weight-only summaries of every head's OV and QK circuits and the
composition scores between heads (Elhage et al. 2021, "A Mathematical Framework for
Transformer Circuits"; TransformerLens ``FactoredMatrix``, ``all_composition_scores``)."""

from __future__ import annotations

from pydantic import Field

from .common import LenientModel, ModelRef, StrictModel, example

CIRCUIT_WEIGHTS_DOC = (
    "The checkpoint's raw weights, as TransformerLens' enable_compatibility_mode("
    "no_processing=True) / from_pretrained_no_processing gives them: no LayerNorm folding "
    "(ln1's and ln_final's weights are not multiplied in), no centring, biases ignored. "
    "Row-vector convention: W_Q, W_K, W_V [d_model, d_head] per head (columns of c_attn), "
    "W_O [d_head, d_model] (rows of c_proj), W_E = wte [d_vocab, d_model], W_U = lm_head.weight^T "
    "[d_model, d_vocab]; W_OV = W_V W_O, W_QK = W_Q W_K^T (d_model x d_model, rank <= d_head, "
    "without the 1/sqrt(d_head) score scaling)."
)


class CircuitsRequest(StrictModel):
    """Weights only: no text."""

    model_config = example(top_k=4)

    top_k: int = Field(8, ge=1, le=1024, description="Singular values per head and circuit "
                       "(at most d_head are returned).")
    composition: bool = Field(True, description="Include the Q-, K- and V-composition scores.")


class HeadCircuit(LenientModel):
    layer: int = Field(description="The head's layer (0-based).")
    head: int = Field(description="The head's index in its layer (0-based).")
    copying_score: float = Field(
        description="Elhage et al. 2021's eigenvalue summary of the full OV circuit W_E W_OV "
        "W_U (d_vocab x d_vocab): sum_i lambda_i / sum_i |lambda_i| over its eigenvalues "
        "(complex moduli), in [-1, 1]; 1 when every eigenvalue is positive (the head copies "
        "the tokens it attends to). Computed on the d_head x d_head matrix W_O W_U W_E W_V, "
        "which has the same nonzero eigenvalues (the cyclic property), never the vocab x vocab "
        "one.")
    positive_eigenvalue_share: float = Field(
        description="sum_i max(Re lambda_i, 0) / sum_i |lambda_i|, in [0, 1]: the positive "
        "eigenvalues' share of the total magnitude (equals (1 + copying_score) / 2 when every "
        "eigenvalue is real).")
    ov_singular_values: list[float] = Field(description="The top singular values of W_OV "
                                            "(descending).")
    qk_singular_values: list[float] = Field(description="The top singular values of W_QK "
                                            "(descending).")
    ov_frobenius: float = Field(description="||W_OV||_F.")
    qk_frobenius: float = Field(description="||W_QK||_F.")


Grid4 = list[list[list[list[float]]]]


class CompositionScores(LenientModel):
    q: Grid4 = Field(description="[layer_a][head_a][layer_b][head_b]: Q-composition of head a "
                    "(earlier) into head b's queries, ||W_OV^a W_QK^b||_F / (||W_OV^a||_F "
                    "||W_QK^b||_F); 0 unless layer_a < layer_b (TransformerLens "
                    "all_composition_scores('Q')).")
    k: Grid4 = Field(description="K-composition: ||W_OV^a (W_QK^b)^T||_F / (...), "
                    "all_composition_scores('K').")
    v: Grid4 = Field(description="V-composition: ||W_OV^a W_OV^b||_F / (...), "
                    "all_composition_scores('V').")


class CircuitsResponse(LenientModel):
    model: ModelRef
    weights: str = Field(description=CIRCUIT_WEIGHTS_DOC)
    n_layers: int = Field(description="Layers of the model.")
    n_heads: int = Field(description="Heads per layer.")
    d_head: int = Field(description="Dimension of each head's query/key/value (d_model / n_heads).")
    qk_definition: str | None = Field(
        None, description="Null for GPT-2. On the rotary families (Llama, Mistral, Qwen2, "
        "Gemma, Gemma 2, GPT-NeoX): what W_QK and the Q-/K-composition scores mean there. RoPE "
        "makes the query-key bilinear form position-dependent (W_Q R(j - i) W_K^T); the served "
        "W_QK = W_Q W_K^T is that form at relative position 0, the matrix TransformerLens' "
        "model.QK and all_composition_scores use (they ignore rotary).")
    heads: list[HeadCircuit] = Field(description="Every head, layer-major.")
    composition: CompositionScores | None = Field(
        None, description="Composition scores (Elhage et al. 2021; TransformerLens "
        "utils.composition_scores), null when not asked.")
