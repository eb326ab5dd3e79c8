package seal

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/idempotency-go/idempotency"
)

// A sealed value is an envelope:
//
//	byte 0      version (envelopeV1)
//	bytes 1-4   the ID of the key that sealed it, big-endian
//	bytes 5-16  the nonce, 12 random bytes
//	then        the AES-256-GCM ciphertext and its 16-byte tag
//
// The associated data that the tag authenticates is assocPrefix, the kind
// of value, the envelope's first five bytes, the record's scope and key
// name, and what the kind adds (see the callers of assoc): a value moved to
// another record, tenant, step or field, or put under another status, does
// not open.
const (
	envelopeV1 = 1
	nonceAt    = 5
	sealedAt   = nonceAt + 12
	tagSize    = 16
	// Overhead is how many bytes an envelope adds to what it seals.
	Overhead = sealedAt + tagSize
)

const assocPrefix = "idempotency-go/seal/v1\x00"

// Kinds of sealed value, each with associated data of its own form.
const (
	kindBody   = 'b' // a response's body
	kindHeader = 'h' // one value of a response's header field
	kindPoint  = 'p' // a recovery point's result
)

// Errors of a value that cannot be opened. None wraps
// idempotency.ErrUnavailable: see Store.Claim.
var (
	// ErrUnknownKey: the value, or the record's fingerprint, was sealed
	// under a key ID that is not configured (removed too early, or never
	// given to this instance). The error names the ID. Restore the key, or
	// see docs/security.md for what else an operator can do.
	ErrUnknownKey = errors.New("seal: sealed under a key that is not configured")
	// ErrUnopenable: a sealed value fails authentication: it was altered,
	// is corrupt, or was moved from another record, tenant or step.
	ErrUnopenable = errors.New("seal: a sealed value does not open (altered, corrupt, or moved from another record)")
	// ErrNotSealed: the record was not written through a seal.Store (made
	// before sealing was turned on, or by an instance without it).
	ErrNotSealed = errors.New("seal: the record was not sealed")
)

// assoc returns the associated data of a value of kind sealed under the
// envelope head head (version and key ID) for the record of k, followed by
// extra, which the kind defines.
func assoc(kind byte, head []byte, k idempotency.Key, extra []byte) []byte {
	b := make([]byte, 0, len(assocPrefix)+1+len(head)+2*binary.MaxVarintLen64+len(k.Scope)+len(k.Name)+len(extra))
	b = append(b, assocPrefix...)
	b = append(b, kind)
	b = append(b, head...)
	b = appendString(b, k.Scope)
	b = appendString(b, k.Name)
	return append(b, extra...)
}

// appendString appends s with its length first, so that no two sequences
// of strings append the same bytes.
func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// sealWith seals plain under k into a new envelope, with the associated
// data that ad returns for the envelope's head.
func sealWith(k *key, plain []byte, ad func(head []byte) []byte) []byte {
	out := make([]byte, sealedAt, Overhead+len(plain))
	out[0] = envelopeV1
	binary.BigEndian.PutUint32(out[1:nonceAt], k.id)
	_, _ = rand.Read(out[nonceAt:sealedAt]) // never fails: see crypto/rand.Read
	return k.aead.Seal(out, out[nonceAt:sealedAt], plain, ad(out[:nonceAt]))
}

// open opens an envelope that sealWith made under a key of r, with the
// associated data that ad returns for its head, and returns what was
// sealed. It fails with ErrNotSealed for bytes that are no envelope of this
// version, ErrUnknownKey for a key ID not in r, and ErrUnopenable when the
// tag does not verify.
func (r *keyring) open(env []byte, ad func(head []byte) []byte) ([]byte, error) {
	if len(env) < Overhead || env[0] != envelopeV1 {
		return nil, ErrNotSealed
	}
	id := binary.BigEndian.Uint32(env[1:nonceAt])
	k, ok := r.byID[id]
	if !ok {
		return nil, fmt.Errorf("%w: key ID %d", ErrUnknownKey, id)
	}
	plain, err := k.aead.Open(nil, env[nonceAt:sealedAt], env[sealedAt:], ad(env[:nonceAt]))
	if err != nil {
		return nil, ErrUnopenable
	}
	return plain, nil
}
