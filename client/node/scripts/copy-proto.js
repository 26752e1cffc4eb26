// Copies the repository's proto into the package before `npm pack` / `npm publish`
// (the `prepack` script) and removes the copy afterwards (`postpack`, with --clean).
// Inside the repository the client loads ../../proto directly, so the copy exists
// only while a tarball is being made.
import { copyFileSync, mkdirSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const pkg = join(dirname(fileURLToPath(import.meta.url)), '..');
const rel = join('latchkey', 'v1', 'latchkey.proto');
const dest = join(pkg, 'proto');

if (process.argv.includes('--clean')) {
  rmSync(dest, { recursive: true, force: true });
} else {
  const src = join(pkg, '..', '..', 'proto', rel);
  mkdirSync(dirname(join(dest, rel)), { recursive: true });
  copyFileSync(src, join(dest, rel));
  console.log(`copied ${src} -> ${join(dest, rel)}`);
}
