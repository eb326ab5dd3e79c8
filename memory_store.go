package idempotency

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/idempotency-go/idempotency/internal/storeerr"
	"github.com/idempotency-go/idempotency/internal/wakeup"
)

// MemoryOptions configures a MemoryStore. The zero value of every field is
// its documented default.
type MemoryOptions struct {
	// MaxRecords bounds the records kept. When it is reached, expired records
	// are dropped; if none has expired, new claims fail with ErrUnavailable
	// rather than forget a live record. Default 100000.
	MaxRecords int
	// Now is the store's clock, by which leases and retention are judged.
	// Default time.Now; tests may move it.
	Now func() time.Time
}

// MemoryStore keeps records in this process. It has the full contract of a
// Store, but only Guards in the same process share it: use it for tests and
// for services that run as one process.
type MemoryStore struct {
	opts MemoryOptions

	mu      sync.Mutex
	records map[Key]*memRecord
	token   uint64 // last token issued, for every key: tokens never repeat
	subs    wakeup.Registry[Key]
}

// memState is the state of a record in a MemoryStore.
type memState uint8

const (
	memInFlight memState = iota + 1
	memCompleted
	memReleased
)

type memRecord struct {
	state       memState
	fingerprint Fingerprint
	operationID string
	attempt     int
	token       uint64
	leaseUntil  time.Time
	expires     time.Time
	created     time.Time
	response    Response
	points      []RecoveryPoint // in flight or released: the steps recorded
}

// NewMemoryStore returns an empty MemoryStore.
func NewMemoryStore(opts MemoryOptions) *MemoryStore {
	if opts.MaxRecords <= 0 {
		opts.MaxRecords = 100000
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &MemoryStore{opts: opts, records: make(map[Key]*memRecord)}
}

// EndsByDeadline implements DeadlineBound: a MemoryStore waits for nothing
// but its lock.
func (s *MemoryStore) EndsByDeadline(as Store) bool { return as == Store(s) }

// Claim implements Store.
func (s *MemoryStore) Claim(_ context.Context, req ClaimRequest) (Claim, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.opts.Now()
	r := s.lookup(req.Key, now)
	if r == nil {
		if len(s.records) >= s.opts.MaxRecords {
			s.dropExpired(now)
			if len(s.records) >= s.opts.MaxRecords {
				return Claim{}, storeerr.Unavailable("claim", fmt.Errorf("memory store full: %d records", s.opts.MaxRecords))
			}
		}
		s.token++
		r = &memRecord{state: memInFlight, fingerprint: req.Fingerprint, operationID: req.OperationID, attempt: 1,
			token: s.token, leaseUntil: now.Add(req.Lease), expires: now.Add(req.Retention), created: now}
		s.records[req.Key] = r
		return Claim{State: Owner, OperationID: r.operationID, Attempt: 1, Token: r.token}, nil
	}
	switch {
	case r.fingerprint != req.Fingerprint:
		return Claim{State: Mismatch}, nil
	case r.state == memCompleted:
		// A copy: a caller that adds a header to its replay must not change
		// what later replays get.
		resp := Response{Status: r.response.Status, Header: r.response.Header.Clone(), Body: bytes.Clone(r.response.Body)}
		return Claim{State: Completed, OperationID: r.operationID, Response: resp}, nil
	case r.state == memInFlight && r.leaseUntil.After(now):
		return Claim{State: InFlight, LeaseLeft: r.leaseUntil.Sub(now)}, nil
	}
	abandoned := r.state == memInFlight
	s.token++
	r.state, r.token, r.leaseUntil = memInFlight, s.token, now.Add(req.Lease)
	r.attempt++
	if r.expires.Before(now.Add(req.Retention)) {
		r.expires = now.Add(req.Retention) // the new owner must not lose the record while it runs
	}
	return Claim{State: Owner, OperationID: r.operationID, Attempt: r.attempt, Token: r.token, Abandoned: abandoned}, nil
}

// Complete implements Store.
func (s *MemoryStore) Complete(_ context.Context, k Key, token uint64, resp Response, retention time.Duration) error {
	// Keep a copy: the caller may reuse its buffers once Complete returns.
	resp.Header = resp.Header.Clone()
	resp.Body = bytes.Clone(resp.Body)
	return s.owned(k, token, func(r *memRecord, now time.Time) {
		r.state, r.response, r.expires, r.points = memCompleted, resp, now.Add(retention), nil
		s.subs.Wake(k)
	})
}

// Release implements Store.
func (s *MemoryStore) Release(_ context.Context, k Key, token uint64) error {
	return s.end(k, token, false)
}

// Forget implements Store.
func (s *MemoryStore) Forget(_ context.Context, k Key, token uint64) error {
	return s.end(k, token, true)
}

// end releases or, with forget, deletes the record owned by token.
func (s *MemoryStore) end(k Key, token uint64, forget bool) error {
	return s.owned(k, token, func(r *memRecord, _ time.Time) {
		if forget {
			delete(s.records, k)
		} else {
			r.state = memReleased
		}
		s.subs.Wake(k)
	})
}

// Heartbeat implements Store.
func (s *MemoryStore) Heartbeat(_ context.Context, k Key, token uint64, lease time.Duration) error {
	return s.renew(k, token, lease)
}

// Abandon implements Store: the lease ends now.
func (s *MemoryStore) Abandon(_ context.Context, k Key, token uint64) error {
	return s.renew(k, token, 0)
}

// renew sets the lease of the record owned by token to end lease from now;
// the expiry moves with it, as Store.Heartbeat says.
func (s *MemoryStore) renew(k Key, token uint64, lease time.Duration) error {
	return s.owned(k, token, func(r *memRecord, now time.Time) {
		renewed := now.Add(lease)
		if moved := renewed.Sub(r.leaseUntil); moved > 0 {
			r.expires = r.expires.Add(moved)
		}
		if renewed.After(r.expires) {
			r.expires = renewed
		}
		r.leaseUntil = renewed
	})
}

// SaveRecoveryPoint implements RecoveryPointStore.
func (s *MemoryStore) SaveRecoveryPoint(_ context.Context, k Key, token uint64, p RecoveryPoint) error {
	p.Result = bytes.Clone(p.Result)
	return s.owned(k, token, func(r *memRecord, _ time.Time) {
		for _, q := range r.points {
			if q.Step == p.Step {
				return
			}
		}
		r.points = append(r.points, p)
	})
}

// RecoveryPoints implements RecoveryPointStore.
func (s *MemoryStore) RecoveryPoints(_ context.Context, k Key, token uint64) ([]RecoveryPoint, error) {
	var ps []RecoveryPoint
	err := s.owned(k, token, func(r *memRecord, _ time.Time) {
		for _, p := range r.points {
			ps = append(ps, RecoveryPoint{Step: p.Step, Result: bytes.Clone(p.Result)})
		}
	})
	return ps, err
}

// Subscribe implements Store. It is confirmed at once: every transition
// wakes the record's subscribers before it returns.
func (s *MemoryStore) Subscribe(_ context.Context, k Key) (Subscription, error) {
	return s.subs.Add(k), nil
}

// Stats counts the records in flight, scanning every record as ListAbandoned
// does.
func (s *MemoryStore) Stats(context.Context) (Stats, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.opts.Now()
	var st Stats
	for _, r := range s.records {
		switch {
		case r.state != memInFlight || !r.expires.After(now):
		case r.leaseUntil.After(now):
			st.InFlight++
		default:
			st.Abandoned++
		}
	}
	return st, nil
}

// ListAbandoned implements Store. It scans every record: the memory store is
// bounded by MaxRecords, and a scan of it is cheap next to a network store's
// round trip.
func (s *MemoryStore) ListAbandoned(_ context.Context, limit int) ([]AbandonedRecord, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.opts.Now()
	var all []dueRecord
	for k, r := range s.records {
		if r.state == memInFlight && !r.leaseUntil.After(now) && r.expires.After(now) {
			all = append(all, dueRecord{AbandonedRecord{Key: k, Fingerprint: r.fingerprint}, r.leaseUntil.UnixNano()})
		}
	}
	return oldestFirst(all, limit), nil
}

// Inspect implements Inspector.
func (s *MemoryStore) Inspect(_ context.Context, k Key) (Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.opts.Now()
	r := s.lookup(k, now)
	if r == nil {
		return Record{}, fmt.Errorf("%w of %v", ErrNoRecord, k)
	}
	return r.record(k, now), nil
}

// ListInFlight implements Inspector, by a scan of every record, as
// ListAbandoned does.
func (s *MemoryStore) ListInFlight(_ context.Context, after string, limit int) ([]Record, string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.opts.Now()
	var recs []Record
	for k, r := range s.records {
		if r.state == memInFlight && r.expires.After(now) {
			recs = append(recs, r.record(k, now))
		}
	}
	return leasePage(recs, func(r Record) leaseCursor {
		return leaseCursor{now.Add(r.LeaseLeft).UnixNano(), r.Key}
	}, after, limit)
}

// record is r, the record of k, as an operator sees it at now.
func (r *memRecord) record(k Key, now time.Time) Record {
	rec := Record{Key: k, OperationID: r.operationID, Fingerprint: r.fingerprint, Attempt: r.attempt, Token: r.token,
		ExpiresIn: r.expires.Sub(now), Age: now.Sub(r.created)}
	for _, p := range r.points {
		rec.Steps = append(rec.Steps, p.Step)
	}
	switch {
	case r.state == memCompleted:
		rec.State = RecordCompleted
		rec.SetResponse(r.response)
	case r.state == memReleased:
		rec.State = RecordReleased
	case r.leaseUntil.After(now):
		rec.State, rec.LeaseLeft = RecordInFlight, r.leaseUntil.Sub(now)
	default:
		rec.State, rec.LeaseLeft = RecordAbandoned, r.leaseUntil.Sub(now)
	}
	return rec
}

func (s *MemoryStore) lookup(k Key, now time.Time) *memRecord {
	r := s.records[k]
	if r != nil && !r.expires.After(now) {
		delete(s.records, k)
		return nil
	}
	return r
}

// owned applies change, under the store's lock and at the store's time now,
// to the record of k if token owns it, and returns ErrFenced otherwise.
func (s *MemoryStore) owned(k Key, token uint64, change func(r *memRecord, now time.Time)) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.opts.Now()
	r := s.lookup(k, now)
	if r == nil || r.state != memInFlight || r.token != token {
		return ErrFenced
	}
	change(r, now)
	return nil
}

func (s *MemoryStore) dropExpired(now time.Time) {
	for k, r := range s.records {
		if !r.expires.After(now) {
			delete(s.records, k)
		}
	}
}
