package postgres

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/storeerr"
	"github.com/idempotency-go/idempotency/internal/wire"
	"github.com/jackc/pgx/v5/pgtype"
)

// A claim is one statement in the common cases: it reads the key's row,
// and a row that decides the claim by itself answers it (a replay, a
// mismatch, a lease to wait out), with no function called; a key with no
// row gets its record made by the create function of schema.sql, in the
// same statement. Every other claim (a takeover, an expired record, a
// first watcher, a claim that raced another's insert) goes on to the claim
// function of schema.sql, which decides it from the latest row.

// claimSQL is the claim statement of the table of n. Its one row says
// whether the key has no row and, if so, the token of the record it made
// (NULL if a concurrent claim made one meanwhile); otherwise the row read.
func claimSQL(n names) string {
	return `SELECT t.key IS NULL, CASE WHEN t.key IS NULL THEN ` + n.Create + `($1, $2, $3, $4, $5, $6) END,
			t.state, t.fingerprint, t.operation_id, t.response, coalesce(t.waiters, false),
			CASE WHEN t.lease_until > now() THEN (extract(epoch FROM t.lease_until - now()) * 1000000)::bigint END,
			coalesce(t.expires_at > now(), false)
		FROM (SELECT) one LEFT JOIN ` + n.Table + ` t ON t.scope = $1 AND t.key = $2`
}

// claimFunctionSQL calls the claim function of the table of n.
func claimFunctionSQL(n names) string {
	return `SELECT o_state, coalesce(o_operation_id, ''), coalesce(o_attempt, 0), coalesce(o_token, 0), o_response,
		coalesce(o_lease_left_us, 0), coalesce(o_abandoned, false)
		FROM ` + n.Claim + `($1, $2, $3, $4, $5, $6, $7)`
}

// Claim implements idempotency.Store.
func (s *Store) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	var r readRow
	err := s.pool.QueryRow(ctx, s.claimSQL, req.Key.Scope, req.Key.Name, req.Fingerprint[:], req.OperationID,
		req.Lease.Microseconds(), req.Retention.Microseconds()).
		Scan(&r.absent, &r.made, &r.state, &r.fingerprint, &r.operationID, &r.response, &r.waiters, &r.leftUS, &r.live)
	switch {
	case err != nil:
		return idempotency.Claim{}, storeerr.Unavailable("postgres claim", err)
	case r.absent && r.made != nil:
		return idempotency.Claim{State: idempotency.Owner, OperationID: req.OperationID, Attempt: 1, Token: uint64(*r.made)}, nil
	case r.absent:
		// Another claim made the record after this statement began.
		return s.claimByFunction(ctx, req)
	}
	if c, ok, err := r.decide(req); ok || err != nil {
		return c, err
	}
	return s.claimByFunction(ctx, req)
}

// readRow is the row the claim statement answers.
type readRow struct {
	absent      bool   // the key had no row
	made        *int64 // the token of the record the statement made, if it did
	state       pgtype.Text
	fingerprint []byte
	operationID pgtype.Text
	response    []byte
	waiters     bool
	leftUS      *int64 // the lease left, when it has not run out
	live        bool   // not expired
}

// decide answers req from the row read, when the row decides it: ok is
// false for a claim only the claim function can apply. A row written by
// hand or by another version can carry what no claim of this version
// stores: such a row fails the claim rather than make up a replay or a
// lease.
func (r readRow) decide(req idempotency.ClaimRequest) (c idempotency.Claim, ok bool, err error) {
	switch {
	case !r.live:
		return c, false, nil
	case !knownState(r.state.String):
		err = fmt.Errorf("unknown record state %q", r.state.String)
	case string(r.fingerprint) != string(req.Fingerprint[:]):
		return idempotency.Claim{State: idempotency.Mismatch}, true, nil
	case r.state.String == "completed":
		c = idempotency.Claim{State: idempotency.Completed, OperationID: r.operationID.String}
		c.Response.Status, c.Response.Header, c.Response.Body, err = wire.ParseResponse(r.response)
		if err == nil && c.OperationID == "" {
			err = errors.New("completed record of no operation ID")
		}
	case r.state.String == "in_progress" && r.leftUS != nil && (!req.Watch || r.waiters):
		c, err = inFlight(*r.leftUS)
	default:
		return c, false, nil
	}
	if err != nil {
		return idempotency.Claim{}, true, storeerr.Unavailable("postgres claim", err)
	}
	return c, true, nil
}

// knownState reports whether state is one the statements write.
func knownState(state string) bool {
	return state == "in_progress" || state == "completed" || state == "released"
}

// inFlight is the answer to a claim of a record in flight with leftUS
// microseconds of its lease left. A lease that ends centuries away (a
// lease_until set by hand) would overflow, and a waiter re-reads within
// the lease left: it is refused.
func inFlight(leftUS int64) (idempotency.Claim, error) {
	if leftUS < 0 || leftUS > int64(math.MaxInt64/time.Microsecond) {
		return idempotency.Claim{}, fmt.Errorf("lease left of %d µs", leftUS)
	}
	return idempotency.Claim{State: idempotency.InFlight, LeaseLeft: time.Duration(leftUS) * time.Microsecond}, nil
}

// claimByFunction applies req by the claim function.
func (s *Store) claimByFunction(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	var r claimRow
	err := s.pool.QueryRow(ctx, s.claimFunctionSQL, req.Key.Scope, req.Key.Name, req.Fingerprint[:], req.OperationID,
		req.Lease.Microseconds(), req.Retention.Microseconds(), req.Watch).
		Scan(&r.state, &r.operationID, &r.attempt, &r.token, &r.response, &r.leftUS, &r.abandoned)
	if err != nil {
		return idempotency.Claim{}, storeerr.Unavailable("postgres claim", err)
	}
	return r.claim()
}

// claimRow is the row the claim function returns (schema.sql), its nulls
// read as zeros.
type claimRow struct {
	state       string
	operationID string
	attempt     int
	token       int64
	response    []byte
	leftUS      int64
	abandoned   bool
}

// claim decodes r, refusing what no claim of this version stores, as
// readRow.decide does.
func (r claimRow) claim() (idempotency.Claim, error) {
	c := idempotency.Claim{OperationID: r.operationID, Attempt: r.attempt, Abandoned: r.abandoned}
	var err error
	switch r.state {
	case "owner":
		c.State, c.Token = idempotency.Owner, uint64(r.token)
		if r.operationID == "" || r.attempt < 1 || r.token < 1 {
			err = fmt.Errorf("owner of operation %q, attempt %d, token %d", r.operationID, r.attempt, r.token)
		}
	case "completed":
		c.State = idempotency.Completed
		c.Response.Status, c.Response.Header, c.Response.Body, err = wire.ParseResponse(r.response)
		if err == nil && r.operationID == "" {
			err = errors.New("completed record of no operation ID")
		}
	case "in_flight":
		c, err = inFlight(r.leftUS)
	case "mismatch":
		c.State = idempotency.Mismatch
	default:
		err = fmt.Errorf("unknown claim state %q", r.state)
	}
	if err != nil {
		return idempotency.Claim{}, storeerr.Unavailable("postgres claim", err)
	}
	return c, nil
}
