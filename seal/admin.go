package seal

import (
	"context"
	"errors"
	"fmt"

	"github.com/idempotency-go/idempotency"
)

// errNoInspector and errNoStats: the inner store lacks the interface a call
// needs.
var (
	errNoInspector = errors.New("seal: the wrapped store is no idempotency.Inspector")
	errNoStats     = errors.New("seal: the wrapped store has no Stats method")
)

// SaveRecoveryPoint implements idempotency.RecoveryPointStore: it saves p
// with its result sealed under the current key, and fails with
// idempotency.ErrNoRecoveryPoints when the inner store keeps no points.
func (s *Store) SaveRecoveryPoint(ctx context.Context, k idempotency.Key, token uint64, p idempotency.RecoveryPoint) error {
	if s.points == nil {
		return idempotency.ErrNoRecoveryPoints
	}
	return s.points.SaveRecoveryPoint(ctx, k, token, s.sealPoint(k, p))
}

// RecoveryPoints implements idempotency.RecoveryPointStore: it returns the
// points opened, or fails as Claim does on a point it cannot open (the
// operation then fails before its next step runs; nothing runs twice), and
// with idempotency.ErrNoRecoveryPoints when the inner store keeps none.
func (s *Store) RecoveryPoints(ctx context.Context, k idempotency.Key, token uint64) ([]idempotency.RecoveryPoint, error) {
	if s.points == nil {
		return nil, idempotency.ErrNoRecoveryPoints
	}
	kept, err := s.points.RecoveryPoints(ctx, k, token)
	if err != nil {
		return nil, err
	}
	out := make([]idempotency.RecoveryPoint, len(kept))
	for i, p := range kept {
		if out[i], err = s.openPoint(k, p); err != nil {
			return nil, fmt.Errorf("seal: %w", err)
		}
	}
	return out, nil
}

// Inspect implements idempotency.Inspector by delegation, without opening
// anything: the record shows the status, the header field names and the
// body's size (the sealed body's, less Overhead), never a header value, the
// body or a step's result. Its fingerprint is unkeyed as ListAbandoned's
// are, and its operation ID is the caller's, untagged.
func (s *Store) Inspect(ctx context.Context, k idempotency.Key) (idempotency.Record, error) {
	if s.inspector == nil {
		return idempotency.Record{}, errNoInspector
	}
	r, err := s.inspector.Inspect(ctx, k)
	if err != nil {
		return r, err
	}
	return s.shown(r), nil
}

// ListInFlight implements idempotency.Inspector by delegation, each record
// shown as Inspect shows it.
func (s *Store) ListInFlight(ctx context.Context, after string, limit int) ([]idempotency.Record, string, error) {
	if s.inspector == nil {
		return nil, "", errNoInspector
	}
	recs, next, err := s.inspector.ListInFlight(ctx, after, limit)
	for i := range recs {
		recs[i] = s.shown(recs[i])
	}
	return recs, next, err
}

// shown is r, as the inner store shows it, as the Store shows it.
func (s *Store) shown(r idempotency.Record) idempotency.Record {
	r.Fingerprint = s.keys.current.unfingerprint(r.Fingerprint)
	r.OperationID, _, _ = untagOperation(r.OperationID)
	if r.State == idempotency.RecordCompleted {
		r.BodySize = max(r.BodySize-Overhead, 0)
	}
	return r
}

// Stats counts the inner store's records, by delegation; it fails when the
// inner store has no Stats method.
func (s *Store) Stats(ctx context.Context) (idempotency.Stats, error) {
	if s.stats == nil {
		return idempotency.Stats{}, errNoStats
	}
	return s.stats.Stats(ctx)
}

// EndsByDeadline implements idempotency.DeadlineBound. It vouches only when
// as is this very Store (a type embedding it inherits the method but not
// the vouch) and the inner store vouches for itself: every call of a Store
// is calls of the inner store on the caller's context and computation
// bounded by the size of what it seals.
func (s *Store) EndsByDeadline(as idempotency.Store) bool {
	d, ok := s.inner.(idempotency.DeadlineBound)
	return ok && as == idempotency.Store(s) && d.EndsByDeadline(s.inner)
}
