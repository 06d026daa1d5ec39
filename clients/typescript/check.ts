// Type-checked by scripts/gen-typescript (tsc --strict): the declarations are usable as intended.
import type { components, paths } from "./attnscope.d.ts";
type Req = components["schemas"]["AttentionRequest"];
type Res = paths["/v1/attention"]["post"]["responses"][200]["content"]["application/json"];
const req: Req = { text: "The cat sat." };            // defaulted fields optional
function first(r: Res): number | null {
  const p = r.attention!.pattern;
  if (Array.isArray(p)) { const row = p[0]; return typeof row === "number" ? row : null; }
  if (p.encoding === "base64") { const l: "full" | "tril" = p.layout ?? "full"; return l === "tril" ? p.shape[0] : p.shape[1]; }
  return null;
}
// @ts-expect-error: encoding takes only "json" | "base64"
const bad: Req = { text: "x", encoding: "hex" };
console.log(req, first, bad);
// the JS client's methods (client.d.ts, generated from the endpoint table) take and give the schemas
import type { AttnscopeClient } from "./client.d.ts";
async function use(c: AttnscopeClient): Promise<number> {
  const r = await c.attention({ text: "The cat sat." }, { binary: false });
  const h = await c.heads({ text: "The cat sat." });
  // @ts-expect-error: heads takes no options (no safetensors form)
  await c.heads({ text: "x" }, { binary: true });
  const k = await c.circuits();  // the body may be empty: every field defaulted
  // @ts-expect-error: heads needs its body (a text or token ids)
  await c.heads();
  return r.model.id.length + h.heads.length + k.heads.length;
}
console.log(use);
