package postgres_test

import (
	"math"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/report"
	"github.com/idempotency-go/idempotency/internal/wire"
)

// testCorruptRows writes rows no claim of this version writes, as far as
// the table's constraints let them in (by hand, by another program, by a
// restore gone wrong), and shows that claims on them fail closed: an error
// wrapping ErrUnavailable, or an answer that runs nothing, never an owner
// of a record that was not released or abandoned, never a replay of a
// response that does not parse.
func testCorruptRows(t *testing.T, f *fixture) {
	s, o := f.store(t)
	ctx := t.Context()
	resp := wire.AppendResponse(nil, okResponse.Status, okResponse.Header, okResponse.Body)
	insert := `INSERT INTO ` + o.Table + ` (scope, key, fingerprint, state, attempt, operation_id, lease_until, expires_at, response)
		VALUES ($1, $2, $3, $4, $5, $6, $7::timestamptz, now() + interval '1 hour', $8)`
	rows, claims := 0, 0
	for i, row := range []struct {
		state, op   string
		attempt     int64
		leaseUntil  string
		response    []byte
		description string
	}{
		{"completed", "op_1", 1, "now", []byte("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"), "a response of garbage"},
		{"completed", "op_1", 1, "now", resp[:3], "a truncated response"},
		{"completed", "op_1", 1, "now", []byte{}, "an empty response"},
		{"completed", "op_1", 1, "now", nil, "no response"},
		{"done", "op_1", 1, "now", resp, "a state of another version"},
		{"in_progress", "op_1", 1, "tomorrow", resp, "a response while in flight"},
		{"completed", "", 1, "now", resp, "no operation ID"},
		{"in_progress", "op_1", 1, "5000-01-01", nil, "a lease that ends in the year 5000"},
		{"in_progress", "op_1", 1, "infinity", nil, "a lease that never ends"},
		{"released", "", 1, "now", nil, "no operation ID"},
		{"released", "op_1", -1, "now", nil, "an attempt below 1"},
		{"released", "op_1", math.MaxInt32, "now", nil, "the last attempt an integer holds"},
	} {
		t.Run(row.state+" with "+row.description, func(t *testing.T) {
			req := request("corrupt-"+strconv.Itoa(i), longLease)
			_, err := f.pool.Exec(ctx, insert, req.Key.Scope, req.Key.Name, req.Fingerprint[:], row.state, row.attempt, row.op, row.leaseUntil, row.response)
			require.NoError(t, err)
			rows++
			// The first claim reads the row; a second reads what the first
			// left, a takeover's record in flight.
			for _, watch := range []bool{false, true} {
				req.Watch = watch
				c, err := s.Claim(ctx, req)
				claims++
				if err != nil {
					require.ErrorIs(t, err, idempotency.ErrUnavailable)
					continue
				}
				require.Equal(t, idempotency.InFlight, c.State, "answered %+v", c)
				// As the database tells it, to the second.
				var left float64
				require.NoError(t, f.pool.QueryRow(ctx, `SELECT extract(epoch FROM lease_until - now()) FROM `+o.Table+
					` WHERE scope = $1 AND key = $2`, req.Key.Scope, req.Key.Name).Scan(&left))
				assert.InDelta(t, left, c.LeaseLeft.Seconds(), 1, "lease left")
			}
		})
	}

	// Inspect refuses a state of another version too.
	_, err := s.Inspect(ctx, key("corrupt-4"))
	require.ErrorIs(t, err, idempotency.ErrUnavailable, "inspecting a record of state done")

	// Recovery points that do not parse are refused to their owner.
	k := key("corrupt-points")
	owner := claim(t, s, request(k.Name, longLease))
	_, err = f.pool.Exec(ctx, `UPDATE `+o.Table+` SET points = set_byte('\x00'::bytea, 0, octet_length(operation_id)) || convert_to(operation_id, 'UTF8') || '\xff'::bytea
		WHERE scope = $1 AND key = $2`, k.Scope, k.Name)
	require.NoError(t, err)
	_, err = s.RecoveryPoints(ctx, k, owner.Token)
	require.ErrorIs(t, err, idempotency.ErrUnavailable)
	require.NotErrorIs(t, err, idempotency.ErrFenced)

	// Points under another operation ID, as a function of an earlier
	// version leaves them on a record made anew, count as none, and a save
	// replaces them.
	k = key("stale-points")
	owner = claim(t, s, request(k.Name, longLease))
	_, err = f.pool.Exec(ctx, `UPDATE `+o.Table+` SET points = '\x066f705f6f6c64'::bytea || $3::bytea
		WHERE scope = $1 AND key = $2`, k.Scope, k.Name, wire.AppendPoint(nil, "charge", []byte(`"ch_old"`)))
	require.NoError(t, err)
	ps, err := s.RecoveryPoints(ctx, k, owner.Token)
	require.NoError(t, err)
	assert.Empty(t, ps, "the points of another operation")
	p := idempotency.RecoveryPoint{Step: "order", Result: []byte(`"ord_1"`)}
	require.NoError(t, s.SaveRecoveryPoint(ctx, k, owner.Token, p))
	ps, err = s.RecoveryPoints(ctx, k, owner.Token)
	require.NoError(t, err)
	assert.Equal(t, []idempotency.RecoveryPoint{p}, ps, "the points saved over another operation's")

	report.Add(t, report.Entry{Suite: "fuzz", Store: "postgres", Faults: map[string]int{"corrupt-row": rows}, Operations: claims})
}
