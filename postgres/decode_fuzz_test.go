package postgres

import (
	"math"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/wire"
)

// FuzzDecodeRow: whatever row the claim function returns (a row written by
// hand or by another version, a response column that was truncated), its
// decoding never panics, and answers a claim of a state the function
// returns, with the fields of that row and only a response that parses;
// anything else fails with ErrUnavailable.
func FuzzDecodeRow(f *testing.F) {
	ok := wire.AppendResponse(nil, 201, http.Header{"Location": {"/v1/charges/1"}, "Set-Cookie": {"a=1", "b=2"}}, []byte(`{"id":1}`))
	for _, r := range []claimRow{
		{state: "owner", operationID: "op_1", attempt: 1, token: 1},
		{state: "owner", operationID: "op_1", attempt: 3, token: 1 << 62, abandoned: true},
		{state: "completed", operationID: "op_1", response: ok},
		{state: "completed", operationID: "op_1", response: wire.AppendResponse(nil, 204, nil, nil)},
		{state: "completed", operationID: "op_1", response: ok[:3]},
		{state: "completed", operationID: "op_1", response: []byte{}},
		{state: "completed", operationID: "op_1", response: []byte("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff")},
		{state: "in_flight", leftUS: time.Minute.Microseconds()},
		{state: "in_flight", leftUS: 0},
		{state: "in_flight", leftUS: math.MaxInt64},
		{state: "in_flight", leftUS: -1},
		{state: "owner", operationID: "", attempt: 2, token: 5},
		{state: "owner", operationID: "op_1", attempt: 0, token: 5},
		{state: "owner", operationID: "op_1", attempt: 1, token: -1},
		{state: "completed", operationID: "", response: ok},
		{state: "mismatch"},
		// Not a state the function returns: another version's, or the
		// table's.
		{state: "released", operationID: "op_1", attempt: 1, token: 1},
		{state: "in_progress", operationID: "op_1", attempt: 1, token: 1},
		{state: "Owner", operationID: "op_1", attempt: 1, token: 1},
		{state: "", operationID: "op_1", response: ok},
	} {
		f.Add(r.state, r.operationID, r.attempt, r.token, r.response, r.leftUS, r.abandoned)
	}
	f.Fuzz(func(t *testing.T, state, op string, attempt int, token int64, response []byte, leftUS int64, abandoned bool) {
		r := claimRow{state: state, operationID: op, attempt: attempt, token: token, response: response, leftUS: leftUS, abandoned: abandoned}
		c, err := r.claim()
		if err != nil {
			require.ErrorIs(t, err, idempotency.ErrUnavailable, "%+v", r)
		} else {
			switch state {
			case "owner":
				require.True(t, op != "" && attempt >= 1 && token >= 1, "%+v: not an owner a claim makes, answered %+v", r, c)
				require.Equal(t, idempotency.Claim{State: idempotency.Owner, OperationID: op, Attempt: attempt, Token: uint64(token), Abandoned: abandoned}, c, "%+v", r)
			case "completed":
				n, herr := wire.HeadLen(response)
				require.NoError(t, herr, "%+v: a response that does not parse answered %+v", r, c)
				require.Equal(t, idempotency.Completed, c.State, "%+v", r)
				require.NotEmpty(t, op, "%+v: a record of no operation ID answered %+v", r, c)
				require.Equal(t, op, c.OperationID, "%+v", r)
				require.Equal(t, response[n:], c.Response.Body, "%+v", r)
			case "in_flight":
				require.Equal(t, idempotency.InFlight, c.State, "%+v", r)
				require.Equal(t, leftUS, c.LeaseLeft.Microseconds(), "%+v: lease left %v", r, c.LeaseLeft)
				require.GreaterOrEqual(t, c.LeaseLeft, time.Duration(0), "%+v", r)
			case "mismatch":
				require.Equal(t, idempotency.Mismatch, c.State, "%+v", r)
			default:
				t.Fatalf("%+v: a state the function never returns answered %+v", r, c)
			}
			if state != "completed" {
				require.Zero(t, c.Response, "%+v: a response from a row of no response", r)
			}
		}

		// A response as Complete stores it reads back as it was.
		want := idempotency.Response{Status: int(uint(attempt) % 1000), Header: http.Header{"X-Op": {op}}, Body: response}
		rt := claimRow{state: "completed", operationID: "op_1", response: wire.AppendResponse(nil, want.Status, want.Header, want.Body)}
		c, err = rt.claim()
		require.NoError(t, err)
		if len(want.Body) == 0 {
			want.Body = []byte{}
		}
		require.Equal(t, idempotency.Claim{State: idempotency.Completed, OperationID: "op_1", Response: want}, c)
	})
}
