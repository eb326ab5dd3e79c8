package seal

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/idempotency-go/idempotency"
)

// Store is an idempotency.Store that keeps its records in another store,
// sealed: what a record keeps of the client's and the operation's data is
// encrypted and authenticated under Keys, and the fingerprint it keeps is
// keyed. Records written through one Store are read only through a Store
// with their key configured.
//
// What the inner store holds, for a reader of it who has no key:
//   - a response's body and every header value: sealed (AES-256-GCM),
//     bound to the record's scope and key name, its status and its header's
//     shape; the status and the header field names stay in clear;
//   - a recovery point's result: sealed, bound to the record and the step's
//     name; the step's name stays in clear;
//   - the fingerprint: a pseudorandom permutation of the request's under a
//     key derived from the secret, which cannot be checked against
//     candidate requests without the secret;
//   - the operation ID, with "~k" and the ID of the key the record's
//     fingerprint was made with appended (the Store removes it again);
//   - scope, key name, state, lease, attempt, token and expiry: in clear,
//     as the store needs them.
//
// A Store is safe for concurrent use. It does not own the inner store:
// close that as before.
type Store struct {
	inner idempotency.Store
	keys  keyring
	// The inner store's optional interfaces, nil where it lacks one.
	points    idempotency.RecoveryPointStore
	inspector idempotency.Inspector
	stats     statser
}

// statser is the Stats method of every store of this module and the
// postgres package.
type statser interface {
	Stats(ctx context.Context) (idempotency.Stats, error)
}

// New returns a Store that seals the records it keeps in inner under keys,
// or an error wrapping ErrBadKeys. inner may be any idempotency.Store; the
// Store implements idempotency.RecoveryPointStore, idempotency.Inspector,
// idempotency.DeadlineBound and a Stats method by delegating to inner's,
// and fails those calls when inner has none (see each method).
//
// A store that runs each operation in one transaction of its own (an
// idempotency.Transactor, such as the postgres package's one-commit mode)
// is refused: NewTx seals it, and keeps that mode.
func New(inner idempotency.Store, keys Keys) (*Store, error) {
	if _, ok := inner.(idempotency.Transactor); ok {
		return nil, fmt.Errorf("seal: %T runs operations in one transaction: seal it with NewTx", inner)
	}
	return newStore(inner, keys)
}

// newStore is New for any inner store.
func newStore(inner idempotency.Store, keys Keys) (*Store, error) {
	if inner == nil {
		return nil, errors.New("seal: New needs a store to wrap")
	}
	r, err := newKeyring(keys)
	if err != nil {
		return nil, err
	}
	s := &Store{inner: inner, keys: r}
	s.points, _ = inner.(idempotency.RecoveryPointStore)
	s.inspector, _ = inner.(idempotency.Inspector)
	s.stats, _ = inner.(statser)
	return s, nil
}

// The tag a claim appends to its operation ID: "~k" and the decimal ID of
// the key that made the claim's fingerprint. A record keeps its first
// claim's, which tells a later claim which key the record's fingerprint
// was made with.
const (
	opTag    = "~k"
	maxOpTag = len(opTag) + 10 // a uint32 in decimal
	// MaxOperationID is the longest operation ID a claim through a Store
	// may carry: the stores' 255 bytes, less the tag.
	MaxOperationID = 255 - maxOpTag
)

func tagOperation(id string, keyID uint32) string {
	return id + opTag + strconv.FormatUint(uint64(keyID), 10)
}

// untagOperation splits a kept operation ID into the caller's and the key
// ID of its tag; tagged is false for an ID without a tag.
func untagOperation(kept string) (id string, keyID uint32, tagged bool) {
	i := strings.LastIndex(kept, opTag)
	if i < 0 {
		return kept, 0, false
	}
	n, err := strconv.ParseUint(kept[i+len(opTag):], 10, 32)
	if err != nil {
		return kept, 0, false
	}
	return kept[:i], uint32(n), true
}

// Claim implements idempotency.Store. It claims with the request's
// fingerprint keyed by the current key. When the record holds another
// fingerprint it asks the inner store's Inspector which key made the
// record's: one of the earlier keys, and Claim claims again with the
// fingerprint keyed by it, so that a retry across a rotation replays or
// takes over its record; the current key, and the answer is Mismatch. (An
// inner store that is no Inspector is claimed again under each earlier key
// in turn.)
//
// A record it cannot vouch for is never replayed and never run again:
// Claim fails with ErrUnknownKey (naming the key ID) when the record's
// fingerprint or stored response was made under a key not configured,
// ErrNotSealed when the record was not written through a seal.Store, and
// ErrUnopenable when its stored response fails authentication. Unlike the
// Store contract's other errors, these do not wrap
// idempotency.ErrUnavailable: the middleware answers them with 503 as it
// does a store's failure, but MiddlewareOptions.FailOpen does not run the
// handler unguarded on them, since the record exists and may be an
// operation that ran.
func (s *Store) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	return s.claim(ctx, req, s.inner.Claim)
}

// claimFunc is how the inner store claims: its Claim, or a Transact.
type claimFunc func(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error)

// claim is Claim, with the inner store's claims made by by.
func (s *Store) claim(ctx context.Context, req idempotency.ClaimRequest, by claimFunc) (idempotency.Claim, error) {
	if len(req.OperationID) == 0 || len(req.OperationID) > MaxOperationID {
		return idempotency.Claim{}, fmt.Errorf("seal: an operation ID of %d bytes, want 1..%d", len(req.OperationID), MaxOperationID)
	}
	c, err := s.claimAs(ctx, req, s.keys.current, by)
	if err != nil || c.State != idempotency.Mismatch {
		return c, err
	}
	if s.inspector == nil {
		return s.claimEarlier(ctx, req, c, by)
	}
	return s.rematch(ctx, req, c, by)
}

// claimAs claims req by by with its fingerprint keyed by k, and answers
// with the caller's operation ID and a stored response opened.
func (s *Store) claimAs(ctx context.Context, req idempotency.ClaimRequest, k *key, by claimFunc) (idempotency.Claim, error) {
	req.Fingerprint = k.fingerprint(req.Fingerprint)
	req.OperationID = tagOperation(req.OperationID, k.id)
	c, err := by(ctx, req)
	if err != nil {
		return c, err
	}
	c.OperationID, _, _ = untagOperation(c.OperationID)
	if c.State == idempotency.Completed {
		if c.Response, err = s.openResponse(req.Key, c.Response); err != nil {
			return idempotency.Claim{}, fmt.Errorf("seal: a claim found %w", err)
		}
	}
	return c, nil
}

// claimEarlier claims req under each earlier key in turn until one does
// not answer Mismatch; mismatch is the answer when none does.
func (s *Store) claimEarlier(ctx context.Context, req idempotency.ClaimRequest, mismatch idempotency.Claim, by claimFunc) (idempotency.Claim, error) {
	for _, k := range s.keys.earlier {
		c, err := s.claimAs(ctx, req, k, by)
		if err != nil || c.State != idempotency.Mismatch {
			return c, err
		}
	}
	return mismatch, nil
}

// rematch answers a claim of req that found a record with another
// fingerprint (mismatch), once the inner Inspector has told which key made
// the record's fingerprint.
func (s *Store) rematch(ctx context.Context, req idempotency.ClaimRequest, mismatch idempotency.Claim, by claimFunc) (idempotency.Claim, error) {
	rec, err := s.inspector.Inspect(ctx, req.Key)
	switch {
	case errors.Is(err, idempotency.ErrNoRecord):
		// Settled and gone since: the key is free, and a claim makes it
		// anew under the current key.
		return s.claimAs(ctx, req, s.keys.current, by)
	case err != nil:
		return idempotency.Claim{}, err
	}
	_, id, tagged := untagOperation(rec.OperationID)
	k, known := s.keys.byID[id]
	switch {
	case !tagged:
		return idempotency.Claim{}, fmt.Errorf("%w: the record of %v", ErrNotSealed, req.Key)
	case !known:
		return idempotency.Claim{}, fmt.Errorf("%w: key ID %d made the fingerprint of the record of %v", ErrUnknownKey, id, req.Key)
	case k == s.keys.current:
		return mismatch, nil // the record of another request
	}
	return s.claimAs(ctx, req, k, by)
}

// Complete implements idempotency.Store: it stores resp sealed under the
// current key.
func (s *Store) Complete(ctx context.Context, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	return s.inner.Complete(ctx, k, token, s.sealResponse(k, resp), retention)
}

// Release implements idempotency.Store by delegation.
func (s *Store) Release(ctx context.Context, k idempotency.Key, token uint64) error {
	return s.inner.Release(ctx, k, token)
}

// Forget implements idempotency.Store by delegation.
func (s *Store) Forget(ctx context.Context, k idempotency.Key, token uint64) error {
	return s.inner.Forget(ctx, k, token)
}

// Heartbeat implements idempotency.Store by delegation.
func (s *Store) Heartbeat(ctx context.Context, k idempotency.Key, token uint64, lease time.Duration) error {
	return s.inner.Heartbeat(ctx, k, token, lease)
}

// Abandon implements idempotency.Store by delegation.
func (s *Store) Abandon(ctx context.Context, k idempotency.Key, token uint64) error {
	return s.inner.Abandon(ctx, k, token)
}

// Subscribe implements idempotency.Store by delegation.
func (s *Store) Subscribe(ctx context.Context, k idempotency.Key) (idempotency.Subscription, error) {
	return s.inner.Subscribe(ctx, k)
}

// ListAbandoned implements idempotency.Store. Each record's fingerprint is
// the kept one unkeyed by the current key: for a record made under the
// current key, the fingerprint it was claimed with; for one made under an
// earlier key, a stand-in that a Claim through this Store keys back to the
// kept fingerprint, so that Guard.Sweep claims it all the same.
func (s *Store) ListAbandoned(ctx context.Context, limit int) ([]idempotency.AbandonedRecord, error) {
	list, err := s.inner.ListAbandoned(ctx, limit)
	for i := range list {
		list[i].Fingerprint = s.keys.current.unfingerprint(list[i].Fingerprint)
	}
	return list, err
}
