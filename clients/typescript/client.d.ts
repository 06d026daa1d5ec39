/**
 * The attnscope JS client (service/web/attnscope.js), typed: one method per endpoint.
 * Generated from the endpoint table by scripts/gen-clients; do not edit.
 */
import type { components } from "./attnscope.d.ts";

type S = components["schemas"];
export interface CallOptions { binary?: boolean; signal?: AbortSignal }

export interface AttnscopeClient {
  /** GET /v1/model: The resident model */
  model(): Promise<S["ModelInfo"]>;
  /** POST /v1/tokenize: Tokenize text(s) */
  tokenize(body: S["TokenizeRequest"]): Promise<S["TokenizeResponse"]>;
  /** POST /v1/attention: Attention patterns (and optionally pre-softmax scores) per layer and head */
  attention(body: S["AttentionRequest"], opts?: CallOptions): Promise<S["AttentionResponse"]>;
  /** POST /v1/heads: Classify every head: pattern scores, induction probe, label */
  heads(body: S["HeadsRequest"]): Promise<S["HeadsResponse"]>;
  /** POST /v1/links: Strongest earlier link(s) of every query token */
  links(body: S["LinksRequest"]): Promise<S["LinksResponse"]>;
  /** POST /v1/trajectories: Hidden-state trajectories of each token through the layers, PCA-projected */
  trajectories(body: S["TrajectoriesRequest"]): Promise<S["TrajectoriesResponse"]>;
  /** POST /v1/verify: Recompute the forward from scratch in float64 and compare it with the served one */
  verify(body: S["VerifyRequest"]): Promise<S["VerifyResponse"]>;
  /** POST /v1/scratch-attention: The textbook scaled dot-product attention on given matrices or token embeddings */
  scratch_attention(body: S["ScratchAttentionRequest"]): Promise<S["ScratchAttentionResponse"]>;
  /** POST /v1/predictions: Next-token predictions */
  predictions(body: S["PredictionsRequest"]): Promise<S["PredictionsResponse"]>;
  /** POST /v1/ablate: Ablate attention heads */
  ablate(body: S["AblateRequest"], opts?: CallOptions): Promise<S["AblateResponse"]>;
  /** POST /v1/patch: Activation patching clean -> corrupted */
  patch(body: S["PatchRequest"]): Promise<S["PatchResponse"]>;
  /** POST /v1/path-patch: Path patching: senders' change carried only along the direct path to receivers (Wang et al. 2022) */
  path_patch(body: S["PathPatchRequest"]): Promise<S["PathPatchResponse"]>;
  /** POST /v1/attention-norms: Value-weighted contribution norms ||alpha f(x)|| per layer and head (Kobayashi et al. 2020) */
  attention_norms(body: S["NormsRequest"], opts?: CallOptions): Promise<S["NormsResponse"]>;
  /** POST /v1/rollout: Attention rollout per layer and attention flow (Abnar & Zuidema 2020) */
  rollout(body: S["RolloutRequest"], opts?: CallOptions): Promise<S["RolloutResponse"]>;
  /** GET /v1/hooks: Hook points of the resident model (TransformerLens 4.x names and shapes) */
  hooks(): Promise<S["HooksResponse"]>;
  /** POST /v1/run: One hooked forward: cache activations, apply interventions, read metrics and gradients (TransformerLens hook names) */
  run(body: S["RunRequest"], opts?: CallOptions): Promise<S["RunResponse"]>;
  /** POST /v1/logit-lens: Logit lens: every residual state through ln_final and the unembedding */
  logit_lens(body: S["LogitLensRequest"]): Promise<S["LogitLensResponse"]>;
  /** POST /v1/logit-attribution: Direct logit attribution to heads, MLPs, embeddings and biases */
  logit_attribution(body: S["LogitAttributionRequest"]): Promise<S["LogitAttributionResponse"]>;
  /** POST /v1/circuits: Weight-only OV/QK circuit summaries and composition scores of every head */
  circuits(body?: S["CircuitsRequest"]): Promise<S["CircuitsResponse"]>;
}
