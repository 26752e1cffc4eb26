import { randomUUID } from 'node:crypto';

/** A lock name no other test uses. */
export function uniqueName(prefix = 'node') {
  return `${prefix}-${randomUUID()}`;
}

/** Resolves with signal.reason once the signal aborts; rejects after `ms`. */
export function aborted(signal, ms = 5000) {
  if (signal.aborted) return Promise.resolve(signal.reason);
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`signal not aborted within ${ms} ms`)), ms);
    signal.addEventListener(
      'abort',
      () => {
        clearTimeout(timer);
        resolve(signal.reason);
      },
      { once: true },
    );
  });
}

/** Rejects if `promise` does not settle within `ms`. */
export function within(promise, ms, what = 'operation') {
  let timer;
  return Promise.race([
    promise,
    new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(`${what} did not finish within ${ms} ms`)), ms);
    }),
  ]).finally(() => clearTimeout(timer));
}
