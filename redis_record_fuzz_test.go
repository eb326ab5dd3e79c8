package idempotency

import (
	"context"
	"errors"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/wire"
)

// FuzzRecordScripts: whatever value sits under a record's key (another
// program's, a truncated one, one from another version), the scripts read it
// without a panic, never make the caller the owner of it or replay it unless
// it is a record of this version that says so, and an owner verb by a token
// the value does not hold changes nothing. On miniredis, whose gopher-lua is
// fast enough to fuzz; TestRedisForeignRecords runs the seeds on redis-server,
// whose Lua 5.1 differs at the edges (string.format, string.match, tonumber).
func FuzzRecordScripts(f *testing.F) {
	for _, s := range recordSeeds() {
		f.Add(s.value, s.token)
	}
	// One server per fuzzing process, reused by every input.
	c := redis.NewClient(&redis.Options{Addr: miniredis.RunT(f).Addr()})
	f.Cleanup(func() { c.Close() })
	s, err := NewRedisStore(c, RedisOptions{})
	require.NoError(f, err)
	f.Cleanup(func() { s.Close() })
	f.Fuzz(func(t *testing.T, v string, token uint64) {
		checkRecordScripts(t, s, c, v, token)
	})
}

// The claim every check makes, and the response its owner verbs complete
// with.
var (
	foreignKey      = Key{Scope: "acct", Name: "foreign"}
	foreignFP       = FingerprintOf("charge", []byte(`{"amount":1}`))
	foreignID       = "claim-of-the-check"
	foreignResponse = Response{Status: 201, Header: http.Header{"Location": {"/v1/charges/1"}}, Body: []byte(`{"id":1}`)}
)

type recordSeed struct {
	value string
	token uint64
}

// heldToken is the token of the seeds in flight.
const heldToken = 7

// recordSeeds returns what the scripts write in every state, every prefix of
// each, and values of other shapes: another version's, another program's.
func recordSeeds() []recordSeed {
	fp := string(foreignFP[:])
	live := strconv.FormatInt(time.Now().Add(time.Hour).UnixMilli(), 10)
	held := strconv.Itoa(heldToken)
	resp := func(r Response) string { return string(wire.AppendResponse(nil, r.Status, r.Header, r.Body)) }
	inFlight := encodeRecord(recordInFlight, fp, "op_1", live+" "+held+" 2 11 op_2")
	released := encodeRecord(recordReleased, fp, "op_1", "0 0 4 00 ")
	completed := encodeRecord(recordCompleted, fp, "op_1", resp(Response{Status: 200, Header: http.Header{
		"Content-Type": {"application/json"}, "Set-Cookie": {"a=1", "b=2"}}, Body: []byte(`{"id":"ch_1"}`)}))
	var seeds []recordSeed
	for _, v := range []string{
		inFlight, released, completed,
		encodeRecord(recordInFlight, fp, "op_1", live+" "+held+" 1 00 "),
		encodeRecord(recordInFlight, fp, "op_1", "1 "+held+" 2 01 op_2"),
		encodeRecord(recordInFlight, fp, "op_1", live+" "+held+" 3 00 "+foreignID),
		encodeRecord(recordInFlight, fp, foreignID, live+" "+held+" 1 00 "),
		encodeRecord(recordCompleted, fp, strings.Repeat("o", 255), resp(Response{Status: 204})),
		// What Complete below stores: its resend succeeds without the token.
		encodeRecord(recordCompleted, fp, "op_1", resp(foreignResponse)),
	} {
		seeds = append(seeds, recordSeed{v, heldToken}, recordSeed{v, 1})
	}
	// Truncated in each state. A value cut within its fingerprint is a
	// mismatch, however short: a few of those do.
	for _, v := range []string{inFlight, released, completed} {
		for _, n := range []int{0, 1, recordOperationIDLenAt / 2} {
			seeds = append(seeds, recordSeed{v[:n], heldToken})
		}
		for n := recordOperationIDLenAt; n < len(v); n++ {
			seeds = append(seeds, recordSeed{v[:n], heldToken})
		}
	}
	for _, v := range []string{
		"hello",
		strings.Repeat("\x00", 64),
		`{"state":"completed","response":"ok"}`,
		// Another version's states, and a version byte before the state.
		"z" + fp + "\x04op_1123 " + held + " 1 00 ",
		"P" + fp + "\x04op_11 " + held + " 1 00 ",
		"\x02p" + fp + "\x04op_11 " + held + " 1 00 ",
		"C" + fp + "\x04op_1" + resp(foreignResponse),
		// This version's states with fields it does not write.
		"p" + fp + "\x04op_1x y z 00 ",
		"p" + fp + "\x04op_1garbage",
		"p" + fp + "\x05op_1",
		"p" + fp + "\x04op_1-1 " + held + " 1 00 ",
		"p" + fp + "\x04op_11e3 " + held + " 1 00 ",
		"p" + fp + "\x04op_10x10 " + held + " 1 00 ",
		"p" + fp + "\x04op_11 " + held + " 1 00",
		"p" + fp + "\x04op_11 " + held + " 1 0 0 ",
		"p" + fp + "\x04op_11  " + held + " 1 00 ",
		"p" + fp + "\x04op_11 " + held + " 1 00 \nsecond line",
		"p" + fp + "\x04op_199999999999999999999 " + held + " 1 00 ",
		"p" + fp + "\x04op_11 99999999999999999999999 1 00 ",
		"p" + fp + "\x04op_11 " + held + " 99999999999999999999 00 ",
		"p" + fp + "\x00" + "1 " + held + " 1 00 ",
		"r" + fp + "\x04op_1",
		"r" + fp + "\x04op_10 0 9007199254740993 00 ",
		"c" + fp + "\xffop_1",
		"c" + fp + "\x04op_1\xff\xff\xff\xff",
		"c" + fp + "\x00" + resp(foreignResponse),
	} {
		seeds = append(seeds, recordSeed{v, heldToken})
	}
	return seeds
}

// encodeRecord spells a record as the scripts do (lua/record.lua): rest is
// the stored response of a completed record, or the fields of one in flight
// or released.
func encodeRecord(state byte, fp, op, rest string) string {
	return string(state) + fp + string([]byte{byte(len(op))}) + op + rest
}

// joinFields spells the fields of a record in flight or released.
func joinFields(f []string) string {
	return f[0] + " " + f[1] + " " + f[2] + " " + f[3] + f[4] + " " + f[5]
}

// recordValue is a record as this version writes it, read by a parser of
// its own so that the scripts are checked against the layout, not against
// the code that reads their replies.
type recordValue struct {
	state  byte
	fp, op string
	rest   string // after the operation ID
	resp   Response
	fields []string // deadline, token, attempt, abandoned, waited, claimer
	// The deadline and attempt, when fields are set.
	dl, att int64
}

// recordFields matches the fields in flight or released as decode in
// lua/record.lua reads them: the deadline and the attempt in at most 15
// digits, which a double holds exactly.
var recordFields = regexp.MustCompile(`(?s)^(\d{1,15}) (\d+) (\d{1,15}) ([01])([01]) (.*)$`)

// parseRecordValue reads v as a record of this version, and reports whether
// it is one: a known state, a fingerprint, an operation ID of 1 to 255 bytes,
// and then a stored response that parses, or the fields in flight or
// released as the scripts match them (lua/record.lua, decode).
func parseRecordValue(v string) (recordValue, bool) {
	const opAt = recordOperationIDAt
	if len(v) < opAt || v[recordOperationIDLenAt] == 0 || len(v) < opAt+int(v[recordOperationIDLenAt]) {
		return recordValue{}, false
	}
	r := recordValue{state: v[0], fp: v[recordFingerprintAt:recordOperationIDLenAt]}
	r.op, r.rest = v[opAt:opAt+int(v[recordOperationIDLenAt])], v[opAt+int(v[recordOperationIDLenAt]):]
	switch r.state {
	case recordCompleted:
		n, err := wire.HeadLen(r.rest)
		if err != nil {
			return recordValue{}, false
		}
		r.resp.Status, r.resp.Header = wire.ParseHead(r.rest[:n])
		r.resp.Body = []byte(r.rest[n:])
		return r, true
	case recordInFlight, recordReleased:
		m := recordFields.FindStringSubmatch(r.rest)
		if m == nil {
			return recordValue{}, false
		}
		r.fields = m[1:]
		r.dl, r.att = number(r.fields[0]), number(r.fields[2])
		return r, true
	}
	return recordValue{}, false
}

// number reads the digits recordFields matched.
func number(digits string) int64 {
	n, _ := strconv.ParseInt(digits, 10, 64) // at most 15 digits: never fails
	return n
}

// holds reports whether the scripts take v to be in flight under token:
// owned() in lua/record.lua compares the token as text, once decode has
// read the fields as recordFields does.
func holds(v string, token uint64) bool {
	if len(v) < recordOperationIDAt || v[0] != recordInFlight || v[recordOperationIDLenAt] == 0 {
		return false
	}
	m := recordFields.FindStringSubmatch(v[min(recordOperationIDAt+int(v[recordOperationIDLenAt]), len(v)):])
	return m != nil && m[2] == strconv.FormatUint(token, 10)
}

// storesResponse reports whether complete.lua takes v for the completed
// record of resp, whatever precedes the response (lua/record.lua, response).
func storesResponse(v string, resp Response) bool {
	return len(v) >= recordOperationIDAt && v[0] == recordCompleted && v[recordOperationIDLenAt] != 0 &&
		v[min(recordOperationIDAt+int(v[recordOperationIDLenAt]), len(v)):] == string(wire.AppendResponse(nil, resp.Status, resp.Header, resp.Body))
}

// checkRecordScripts sets v under a record's key and runs every verb on it
// through s: the claim (with and without Watch) and the owner verbs by token,
// each on v afresh. It returns the number of store calls it made.
func checkRecordScripts(t *testing.T, s *RedisStore, c *redis.Client, v string, token uint64) (calls int) {
	ctx := context.Background()
	k := foreignKey
	rec, _ := s.recordKey(k)
	r, ok := parseRecordValue(v)
	// serverNow returns the server's clock, in ms as the scripts read it.
	serverNow := func() int64 {
		now, err := c.Time(ctx).Result()
		require.NoError(t, err)
		return now.UnixMilli()
	}
	type ran struct {
		t0, t1 int64 // the server's clock before and after
		after  string
		exists bool
		err    error
	}
	// run sets v and runs verb on it.
	run := func(verb func() error) ran {
		require.NoError(t, c.Set(ctx, rec, v, time.Hour).Err())
		x := ran{t0: serverNow()}
		x.err = verb()
		calls++
		x.t1 = serverNow()
		after, err := c.Get(ctx, rec).Result()
		if !errors.Is(err, redis.Nil) {
			require.NoError(t, err)
			x.after, x.exists = after, true
		}
		return x
	}

	for _, watch := range []bool{false, true} {
		var cl Claim
		x := run(func() (err error) {
			cl, err = s.Claim(ctx, ClaimRequest{Key: k, Fingerprint: foreignFP, OperationID: foreignID,
				Lease: time.Minute, Retention: time.Hour, Watch: watch})
			return err
		})
		err, t0, t1, after := x.err, x.t0, x.t1, x.after
		if err != nil {
			require.ErrorIs(t, err, ErrUnavailable, "claim of %q", v)
			continue
		}
		// Any value whose bytes where a fingerprint goes are not the
		// request's is a mismatch, whatever else it holds.
		if fp := v[min(recordFingerprintAt, len(v)):min(recordOperationIDLenAt, len(v))]; fp != string(foreignFP[:]) {
			require.Equal(t, Mismatch, cl.State, "claim of %q, a value of another fingerprint", v)
			continue
		}
		require.NotEqual(t, Mismatch, cl.State, "claim of %q, a value of this fingerprint", v)
		require.True(t, ok, "claim of %q, not a record of this version, answered %+v", v, cl)
		switch r.state {
		case recordCompleted:
			require.Equal(t, Claim{State: Completed, OperationID: r.op, Response: r.resp}, cl, "claim of %q", v)
			require.Equal(t, v, after, "a replay changed the record")
			continue
		case recordInFlight:
			if claimer := r.fields[5]; claimer == foreignID || claimer == "" && r.op == foreignID {
				require.Equal(t, Claim{State: Owner, OperationID: r.op, Attempt: int(r.att), Token: parseToken(t, r.fields[1]),
					Abandoned: r.fields[3] == "1"}, cl, "claim of %q by the claim that made its owner", v)
				require.Equal(t, v, after, "a claim run again changed the record")
				continue
			}
			if cl.State == InFlight {
				require.Greater(t, r.dl, t0, "claim of %q, whose lease ended, is in flight", v)
				left := cl.LeaseLeft.Milliseconds()
				require.True(t, left > 0 && left >= r.dl-t1 && left <= r.dl-t0, "claim of %q: %v left, want %d..%d ms", v, cl.LeaseLeft, r.dl-t1, r.dl-t0)
				want := v
				if watch && r.fields[4] == "0" {
					// A waiter registers: only the waited flag changes.
					f := append([]string(nil), r.fields...)
					f[4] = "1"
					want = encodeRecord(r.state, r.fp, r.op, joinFields(f))
				}
				require.Equal(t, want, after, "claim of %q in flight", v)
				continue
			}
			require.LessOrEqual(t, r.dl, t1, "claim of %q, whose lease is live, took it over", v)
		}
		// Released, or in flight past its lease: taken over.
		require.Equal(t, Owner, cl.State, "claim of %q", v)
		assert.Equal(t, r.op, cl.OperationID, "a takeover keeps the operation ID")
		assert.Equal(t, int(r.att)+1, cl.Attempt)
		assert.Equal(t, r.state == recordInFlight, cl.Abandoned)
		n, ok := parseRecordValue(after)
		require.True(t, ok, "the record %q a takeover of %q left", after, v)
		assert.Equal(t, []string{strconv.FormatUint(cl.Token, 10), strconv.Itoa(cl.Attempt), foreignID},
			[]string{n.fields[1], n.fields[2], n.fields[5]}, "token, attempt and claimer of the record a takeover of %q left", v)
		assert.Equal(t, recordValue{state: recordInFlight, fp: r.fp, op: r.op}, recordValue{state: n.state, fp: n.fp, op: n.op})
	}

	held := holds(v, token)
	for _, verb := range []struct {
		name string
		run  func() error
	}{
		{"complete", func() error { return s.Complete(ctx, k, token, foreignResponse, time.Hour) }},
		{"release", func() error { return s.Release(ctx, k, token) }},
		{"forget", func() error { return s.Forget(ctx, k, token) }},
		{"heartbeat", func() error { return s.Heartbeat(ctx, k, token, time.Minute) }},
		{"abandon", func() error { return s.Abandon(ctx, k, token) }},
	} {
		x := run(verb.run)
		err, t0, t1, after, exists := x.err, x.t0, x.t1, x.after, x.exists
		if !held {
			if err == nil && verb.name == "complete" && storesResponse(v, foreignResponse) {
				// The resend of a completion that was stored.
			} else if !errors.Is(err, ErrFenced) {
				require.ErrorIs(t, err, ErrUnavailable, "%s of %q by token %d", verb.name, v, token)
			}
			require.True(t, exists, "%s of %q by token %d deleted it", verb.name, v, token)
			require.Equal(t, v, after, "%s of %q by token %d", verb.name, v, token)
			continue
		}
		// holds(v) implies ok: v is a record of this version.
		require.NoError(t, err, "%s of %q by the token it holds", verb.name, v)
		if verb.name == "forget" {
			require.False(t, exists, "forget of %q left %q", v, after)
			continue
		}
		n, nok := parseRecordValue(after)
		require.True(t, nok, "%s of %q left %q", verb.name, v, after)
		require.Equal(t, []string{r.fp, r.op}, []string{n.fp, n.op}, "%s of %q left %q", verb.name, v, after)
		switch verb.name {
		case "complete":
			assert.Equal(t, byte(recordCompleted), n.state)
			assert.Equal(t, foreignResponse, n.resp)
		case "release":
			assert.Equal(t, encodeRecord(recordReleased, r.fp, r.op, "0 0 "+r.fields[2]+" 00 "), after)
		case "heartbeat", "abandon":
			lease := int64(0)
			if verb.name == "heartbeat" {
				lease = time.Minute.Milliseconds()
			}
			assert.Equal(t, byte(recordInFlight), n.state)
			assert.Equal(t, r.fields[1:], n.fields[1:], "%s of %q changed more than the deadline", verb.name, v)
			assert.True(t, n.dl >= t0+lease && n.dl <= t1+lease, "%s of %q: deadline %d, want %d..%d", verb.name, v, n.dl, t0+lease, t1+lease)
		}
	}
	return calls
}

func parseToken(t *testing.T, s string) uint64 {
	n, err := strconv.ParseUint(s, 10, 64)
	require.NoError(t, err)
	return n
}
