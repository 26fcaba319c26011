// Bundle the dashboard into one folder: index.html, app.js, app.css and KaTeX's woff2 fonts.
// Deterministic: no hashes, no timestamps, no source maps, so a rebuild reproduces the shipped bytes.
import { build } from "esbuild";
import { copyFileSync, mkdirSync, rmSync } from "node:fs";
import { join } from "node:path";

const out = process.argv[2];
if (!out) {
  console.error("usage: node build.mjs <output folder>");
  process.exit(2);
}
rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
await build({
  entryPoints: { app: "src/main.js" },
  bundle: true,
  minify: true,
  format: "iife",
  target: ["es2020"],
  outdir: out,
  assetNames: "fonts/[name]",
  loader: { ".woff2": "file", ".woff": "empty", ".ttf": "empty" },
  legalComments: "none",
  logLevel: "warning",
});
copyFileSync("src/index.html", join(out, "index.html"));
