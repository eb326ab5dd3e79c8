package idempotency

import (
	"cmp"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// This file is the operator's side: looking into a store's records
// (Inspector) and ending one by hand (Guard.Act), as the seeds' recovery
// expects when no automatic recovery can.

// ErrNoRecord: the store holds no record of the key (none was made, or its
// retention ran out, or it was forgotten).
var ErrNoRecord = errors.New("idempotency: no record")

// ErrLiveOwner: an operator's action was refused because an owner holds the
// record under a live lease; OperatorAction.Force ends that lease first.
var ErrLiveOwner = errors.New("idempotency: the record's owner holds a live lease")

// RecordState is the state a record is in, as an operator sees it.
type RecordState int

const (
	// RecordInFlight: an owner holds the record under a live lease.
	RecordInFlight RecordState = iota + 1
	// RecordAbandoned: in flight, but its lease ran out unsettled; the next
	// claim takes it over.
	RecordAbandoned
	// RecordCompleted: its outcome is stored and replayed.
	RecordCompleted
	// RecordReleased: ended without an outcome; the next claim runs it.
	RecordReleased
)

var recordStateNames = [...]string{RecordInFlight: "in_flight", RecordAbandoned: "abandoned",
	RecordCompleted: "completed", RecordReleased: "released"}

// String returns the state's name in snake case.
func (s RecordState) String() string {
	if s > 0 && int(s) < len(recordStateNames) {
		return recordStateNames[s]
	}
	return fmt.Sprintf("RecordState(%d)", int(s))
}

// Record is one record as an Inspector shows it to an operator. Of a stored
// response it shows the status, the header names and the body's size,
// never the body or the header values, which may hold secrets.
type Record struct {
	Key         Key
	State       RecordState
	OperationID string
	Fingerprint Fingerprint
	// Attempt and Token are the current owner's, or the last one's for a
	// released record; a completed record has them where the store keeps
	// them (PostgreSQL, memory), and zero otherwise (Redis).
	Attempt int
	Token   uint64
	// LeaseLeft is what is left of the owner's lease: positive in flight,
	// zero or negative once it ran out (abandoned); zero when settled.
	LeaseLeft time.Duration
	// ExpiresIn is how long the record is kept still, by the store's clock.
	ExpiresIn time.Duration
	// Age is how long ago the record was made, where the store keeps that
	// (PostgreSQL, memory); zero otherwise.
	Age time.Duration
	// Of a completed record: the stored status, its header names, sorted,
	// and the body's size in bytes.
	Status      int
	HeaderNames []string
	BodySize    int
	// Steps names the steps that a record in flight or released recorded
	// (see Step), in order; never their results.
	Steps []string
}

// Inspector is implemented by a store whose records an operator can look
// into: every store of this module and the PostgreSQL store. Both calls
// read only, by the store's own clock.
type Inspector interface {
	// Inspect returns k's record, or an error wrapping ErrNoRecord.
	Inspect(ctx context.Context, k Key) (Record, error)
	// ListInFlight returns up to limit records in flight, abandoned ones
	// included, the earliest lease end first, and the cursor of the page
	// after them ("" after the last page). after is "" for the first page,
	// or the cursor a previous call returned. Its cost follows the records
	// in flight, not every record kept.
	ListInFlight(ctx context.Context, after string, limit int) ([]Record, string, error)
}

// SetResponse shows resp as the stored response of r, a completed record:
// its status, header names and body size. For store implementers.
func (r *Record) SetResponse(resp Response) {
	r.Status, r.BodySize = resp.Status, len(resp.Body)
	r.HeaderNames = make([]string, 0, len(resp.Header))
	for name := range resp.Header {
		r.HeaderNames = append(r.HeaderNames, name)
	}
	slices.Sort(r.HeaderNames)
}

// leaseCursor orders records in flight by lease end, then key, and spells
// a position in that order as a page cursor.
type leaseCursor struct {
	leaseEnd int64 // in the store's own unit
	key      Key
}

func (c leaseCursor) compare(d leaseCursor) int {
	return cmp.Or(cmp.Compare(c.leaseEnd, d.leaseEnd), cmp.Compare(c.key.Scope, d.key.Scope), cmp.Compare(c.key.Name, d.key.Name))
}

func (c leaseCursor) String() string { return PageCursor(c.leaseEnd, c.key) }

// PageCursor spells a position in ListInFlight's order, a lease end in the
// store's own unit and a key, as a page cursor; ParsePageCursor reads one
// back. For store implementers.
func PageCursor(leaseEnd int64, k Key) string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(leaseEnd, 10) + "\x00" + k.Scope + "\x00" + k.Name))
}

// ParsePageCursor reads a cursor that PageCursor made.
func ParsePageCursor(s string) (leaseEnd int64, k Key, err error) {
	b, err := base64.RawURLEncoding.DecodeString(s)
	parts := strings.SplitN(string(b), "\x00", 3)
	if err == nil && len(parts) == 3 {
		leaseEnd, err = strconv.ParseInt(parts[0], 10, 64)
	}
	if err != nil || len(parts) != 3 {
		return 0, Key{}, fmt.Errorf("idempotency: malformed cursor %q", s)
	}
	return leaseEnd, Key{Scope: parts[1], Name: parts[2]}, nil
}

// leasePage sorts records by cursor, keeps those after after ("" for all),
// and returns up to limit of them with the next page's cursor.
func leasePage(recs []Record, at func(Record) leaseCursor, after string, limit int) ([]Record, string, error) {
	if limit <= 0 {
		return nil, after, nil
	}
	var from *leaseCursor
	if after != "" {
		end, k, err := ParsePageCursor(after)
		if err != nil {
			return nil, "", err
		}
		from = &leaseCursor{end, k}
	}
	recs = slices.DeleteFunc(recs, func(r Record) bool { return from != nil && at(r).compare(*from) <= 0 })
	slices.SortFunc(recs, func(a, b Record) int { return at(a).compare(at(b)) })
	if len(recs) <= limit {
		return recs, "", nil
	}
	return recs[:limit], at(recs[limit-1]).String(), nil
}

// OperatorAction is what an operator does to one record by hand.
type OperatorAction struct {
	// Disposition: Keep settles the record with Response, which retries
	// then replay; Release lets the next retry run the operation; Forget
	// makes the key new again.
	Disposition Disposition
	Response    Response
	// Force ends a live owner's lease first. Without it an action on a
	// record whose owner's lease is live fails with ErrLiveOwner.
	Force bool
}

// Act ends the record that seen shows (from an Inspector) as the operator
// says, through the same store calls as an owner, so it is fenced the same
// way: it takes the record over by its own claim, as a retry would once the
// lease runs out, and fails with ErrFenced, changing nothing, if the record
// changed since it was inspected. Only records in flight, abandoned or
// released can be acted on. The Guard's Observer is told of the action as
// an EventOperator, with Op naming the store call.
func (g *Guard) Act(ctx context.Context, seen Record, a OperatorAction) (err error) {
	op := OpClaim
	defer func() {
		g.observe(ctx, Event{Kind: EventOperator, Scope: seen.Key.Scope, Attempt: seen.Attempt + 1, Op: op, Err: err})
	}()
	switch {
	case seen.State != RecordInFlight && seen.State != RecordAbandoned && seen.State != RecordReleased:
		return fmt.Errorf("idempotency: a record %v cannot be acted on", seen.State)
	case a.Disposition != Keep && a.Disposition != Release && a.Disposition != Forget:
		return fmt.Errorf("idempotency: an operator cannot %v a record", a.Disposition)
	case seen.State == RecordInFlight && !a.Force:
		return ErrLiveOwner
	case seen.State == RecordInFlight:
		op = OpAbandon
		if err := g.store.Abandon(ctx, seen.Key, seen.Token); err != nil {
			return err
		}
	}
	op = OpClaim
	c, err := g.store.Claim(ctx, ClaimRequest{Key: seen.Key, Fingerprint: seen.Fingerprint,
		OperationID: newOperationID(), Lease: g.opts.Lease, Retention: g.opts.Retention})
	switch {
	case err != nil:
		return err
	case c.State != Owner:
		return fmt.Errorf("%w: the record changed since it was inspected (now %v)", ErrFenced, c.State)
	case c.Attempt != seen.Attempt+1:
		// The record changed in between: give it back as this claim found
		// it, for its next claim.
		_ = giveBack(context.WithoutCancel(ctx), g.store, seen.Key, c)
		return fmt.Errorf("%w: the record changed since it was inspected (attempt %d, not %d)", ErrFenced, c.Attempt-1, seen.Attempt)
	}
	op = settleOp(a.Disposition)
	return apply(ctx, g.store, seen.Key, c.Token, a.Response, a.Disposition, g.opts.Retention)
}
