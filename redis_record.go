package idempotency

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/idempotency-go/idempotency/internal/wire"
)

// This file holds the Redis store's layout: the keys a record uses, and the
// values under them as Go reads them. lua/record.lua writes and reads the
// same values: change the two together (TestRecordLayout checks that they
// agree).

// The value of a record, as lua/record.lua lays it out (offsets from 0):
// the state, the request's fingerprint, the operation ID's length in one
// byte and the operation ID; then, for a completed record, the stored
// response (internal/wire).
const (
	recordCompleted = 'c' // COMPLETED in lua/record.lua
	recordInFlight  = 'p' // IN_FLIGHT
	recordReleased  = 'r' // RELEASED

	recordFingerprintAt    = 1                                        // FINGERPRINT_FIRST - 1
	recordOperationIDLenAt = recordFingerprintAt + len(Fingerprint{}) // OP_LEN_AT - 1
	recordOperationIDAt    = recordOperationIDLenAt + 1
)

// The value of a record's recovery points, as lua/record.lua lays it out
// (TestRecoveryPointsLayout checks it): a marker byte (POINTS), the
// operation ID's length in one byte and the operation ID of the record they
// belong to, then their entries (internal/wire), in the order saved. The
// marker is no record's state, so a tool that reads the first byte of every
// key under the prefix as a state counts none of them. Points under another
// operation ID are those of an earlier record of the same key, and count as
// none. Only the scripts read the marker and the operation ID.

// pointsSuffix follows a record's key in the key of its recovery points,
// which so shares the record's hash tag. Every record's key ends with its
// key's name, and a space is no byte of a name (Key.Validate), so no
// record's key is the points key of another.
const pointsSuffix = " points"

// buckets is the number of hash tags records are spread over. Records share
// a tag with their bucket's token sequence and in-flight index, so a claim
// is one script on one slot; 1024 tags still spread records over every
// master of a cluster, and a sweep reads 1024 small indexes, whatever the
// number of records kept.
const buckets = 1024

// bucketKeys are the keys the records of one bucket share: its token
// sequence and its in-flight index. They are boxed once, since every script
// call sends them and boxing a string allocates.
type bucketKeys struct{ seq, leases any }

// recordKeys are the keys of one record: its own, and that of its recovery
// points. The scripts take them as *string, which go-redis sends as the
// string and which, unlike a string, boxes into an argument without
// allocating.
type recordKeys struct{ rec, points string }

// keysOf returns the keys of k's record, cut from one string, and the keys
// of its bucket. The scope is length-prefixed, so no (scope, name) pair can
// be spelled as another, and the spelling parses back (see
// parseRecordName).
func (s *RedisStore) keysOf(k Key) (*recordKeys, *bucketKeys) {
	bucket := bucketOf(k)
	var buf [256]byte // most keys are built on the stack, and copied once
	b := s.appendTag(buf[:0], bucket)
	b = strconv.AppendInt(b, int64(len(k.Scope)), 10)
	b = append(append(append(append(b, ':'), k.Scope...), ':'), k.Name...)
	both := string(append(b, pointsSuffix...))
	return &recordKeys{rec: both[:len(b)], points: both}, &s.buckets[bucket]
}

// recordKey returns the key of k's record, and the keys of its bucket.
func (s *RedisStore) recordKey(k Key) (string, *bucketKeys) {
	ks, bk := s.keysOf(k)
	return ks.rec, bk
}

func parseRecordName(s string) (Key, bool) {
	n, rest, ok := strings.Cut(s, ":")
	l, err := strconv.Atoi(n)
	if !ok || err != nil || l < 0 || len(rest) < l+1 || rest[l] != ':' {
		return Key{}, false
	}
	return Key{Scope: rest[:l], Name: rest[l+1:]}, true
}

// bucketTag is the prefix, hash tag included, of a bucket's keys.
func (s *RedisStore) bucketTag(bucket uint32) string {
	return string(s.appendTag(nil, bucket))
}

func (s *RedisStore) appendTag(b []byte, bucket uint32) []byte {
	b = append(append(b, s.prefix...), '{')
	return append(strconv.AppendUint(b, uint64(bucket), 10), "}:"...)
}

func bucketOf(k Key) uint32 {
	// FNV-1a: stable across processes and versions. Collisions only share a
	// bucket; the key itself below is unambiguous.
	h := uint32(2166136261)
	for _, part := range [2]string{k.Scope, k.Name} {
		for i := 0; i < len(part); i++ {
			h = (h ^ uint32(part[i])) * 16777619
		}
		h *= 16777619
	}
	return h % buckets
}

// completedClaim reads a completed record, which claim.lua replies with
// whole.
func completedClaim(rec string) (Claim, error) {
	const head = recordOperationIDAt
	// An operation ID is 1 to 255 bytes (see RedisStore.Claim).
	if len(rec) < head || rec[0] != recordCompleted || rec[recordOperationIDLenAt] == 0 || len(rec) < head+int(rec[recordOperationIDLenAt]) {
		return Claim{}, fmt.Errorf("unexpected claim reply %q", rec)
	}
	end := head + int(rec[recordOperationIDLenAt])
	n, err := wire.HeadLen(rec[end:])
	if err != nil {
		return Claim{}, err
	}
	// One copy holds the operation ID and the response's head, whose
	// strings are cut from it; not the body, which it would keep alive.
	kept := strings.Clone(rec[head : end+n])
	c := Claim{State: Completed, OperationID: kept[:end-head]}
	status, header := wire.ParseHead(kept[end-head:])
	status, body, err := wire.Body(status, []byte(rec[end+n:]))
	if err != nil {
		return Claim{}, err
	}
	c.Response = Response{Status: status, Header: header, Body: body}
	return c, nil
}

// inspected reads the record of k, its value v with ttl ms to live and the
// entries of its recovery points, at now ms by its server's clock, as
// Inspector shows it.
func inspected(k Key, v, points string, ttl, now int64) (Record, error) {
	r := Record{Key: k, ExpiresIn: time.Duration(ttl) * time.Millisecond}
	head := recordOperationIDAt
	if len(v) < head || v[recordOperationIDLenAt] == 0 || len(v) < head+int(v[recordOperationIDLenAt]) {
		return Record{}, fmt.Errorf("unexpected record %q", v)
	}
	end := head + int(v[recordOperationIDLenAt])
	r.Fingerprint, r.OperationID = Fingerprint([]byte(v[recordFingerprintAt:recordOperationIDLenAt])), v[head:end]
	if v[0] == recordCompleted {
		c, err := completedClaim(v)
		if err != nil {
			return Record{}, err
		}
		r.State = RecordCompleted
		r.SetResponse(c.Response)
		return r, nil
	}
	// "<deadline> <token> <attempt> <abandoned><waited> <claimer>"
	f := strings.SplitN(v[end:], " ", 5)
	if len(f) < 4 || (v[0] != recordInFlight && v[0] != recordReleased) {
		return Record{}, fmt.Errorf("unexpected record %q", v)
	}
	deadline, err1 := strconv.ParseInt(f[0], 10, 64)
	token, err2 := strconv.ParseUint(f[1], 10, 64)
	attempt, err3 := strconv.Atoi(f[2])
	if err := errors.Join(err1, err2, err3); err != nil {
		return Record{}, fmt.Errorf("unexpected record %q: %w", v, err)
	}
	r.Token, r.Attempt = token, attempt
	ps, err := wire.ParsePoints([]byte(points))
	if err != nil {
		return Record{}, err
	}
	for _, p := range ps {
		r.Steps = append(r.Steps, p.Step)
	}
	switch {
	case v[0] == recordReleased:
		r.State = RecordReleased
	case deadline > now:
		r.State, r.LeaseLeft = RecordInFlight, time.Duration(deadline-now)*time.Millisecond
	default:
		r.State, r.LeaseLeft = RecordAbandoned, time.Duration(deadline-now)*time.Millisecond
	}
	return r, nil
}
