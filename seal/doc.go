// Package seal keeps idempotency records sealed: a Store wraps any
// idempotency.Store (Redis standalone or Cluster, PostgreSQL, memory) and
// encrypts what a record keeps of the client's and the operation's data,
// so that a reader of the store, a backup or a replica learns neither a
// response nor a step's result, nor, by trying candidates, a request.
//
//   - A response's body and header values, and a recovery point's result,
//     are sealed with AES-256-GCM; each sealed value is bound to its
//     record's scope and key name (and to its step, or to its response's
//     status and header shape), so that one moved to another record or
//     tenant does not open: the claim fails, and nothing is replayed.
//   - The fingerprint a record keeps is keyed: a pseudorandom permutation
//     of the request's, built from HMAC-SHA-256 under a key derived from
//     the secret, never the bare SHA-256 of the request.
//   - Keys rotate: Keys.Current seals every new value and keys every claim;
//     Keys.Earlier still opens what was sealed, and matches what was keyed,
//     before a rotation, so that a client's retry across a rotation
//     replays. A record whose key was removed is neither replayed nor run
//     again: its claim fails with ErrUnknownKey, which names the key.
//
// The status and header field names stay in clear, as the Inspector shows
// them to an operator; so do step names, scopes and key names. The
// repository's docs/security.md walks through sealing, keyed fingerprints
// and rotating keys step by step.
//
// The postgres package's CompleteTx and StepTx write the caller's response
// or result themselves, in the caller's transaction: on a Guard made with
// a Store they fail with idempotency.ErrForeignStore before writing
// anything, rather than store clear text. Its one-commit mode, which stores
// the response itself in the operation's transaction, is sealed by NewTx
// (a TxStore), which keeps that mode; New refuses it.
package seal
