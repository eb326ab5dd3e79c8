package wire

import (
	"bytes"
	"compress/flate"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func decode(t testing.TB, enc []byte) (int, http.Header, []byte) {
	n, err := HeadLen(enc)
	require.NoError(t, err)
	status, h := ParseHead(string(enc[:n]))
	return status, h, enc[n:]
}

func TestResponseRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		status int
		header http.Header
		body   string
	}{
		{200, nil, ""},
		{201, http.Header{"Content-Type": {"application/json"}}, `{"id":"ch_1"}`},
		{999, http.Header{"Set-Foo": {"a", "", "c"}, "X": {""}, "Empty": {}}, "\x00\xff body with zero bytes"},
		{0, http.Header{"A": {"1"}, "B": {"2", "3"}}, string(make([]byte, 300))},
	} {
		enc := AppendResponse([]byte("prefix"), tc.status, tc.header, []byte(tc.body))
		require.Equal(t, "prefix", string(enc[:6]))
		status, h, body := decode(t, enc[6:])
		assert.Equal(t, tc.status, status)
		assert.Equal(t, tc.body, string(body))
		want := http.Header{}
		for name, vs := range tc.header {
			if len(vs) > 0 {
				want[name] = vs
			}
		}
		assert.Equal(t, want, h)
		// Appending to one value must not overwrite another's.
		for name := range h {
			h[name] = append(h[name], "added")
		}
		for name, vs := range want {
			assert.Equal(t, append(append([]string(nil), vs...), "added"), h[name], name)
		}
	}
}

func TestResponseCorrupt(t *testing.T) {
	valid := AppendResponse(nil, 201, http.Header{"Location": {"/v1/x"}}, []byte("body"))
	n, err := HeadLen(valid)
	require.NoError(t, err)
	for _, enc := range [][]byte{
		nil,
		{0x80},              // a varint that never ends
		{0xd0, 0x0f, 0},     // status 2000, past a compressed form's
		{200},               // no field count
		{200, 1},            // a field count and no field
		{200, 1, 5, 'a'},    // a name shorter than its length
		{200, 0x7f, 1, 'a'}, // more fields than bytes could hold
		{200, 1, 1, 'a', 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}, // a length past 2^64
		valid[:n-1],
	} {
		_, err := HeadLen(enc)
		assert.ErrorIs(t, err, ErrCorrupt, "%q", enc)
		_, err = HeadLen(string(enc))
		assert.ErrorIs(t, err, ErrCorrupt, "%q as a string", enc)
	}
}

// FuzzResponse holds HeadLen to never panic on foreign bytes, and a head it
// accepts to decode to a response that encodes back to what it read.
func FuzzResponse(f *testing.F) {
	f.Add(AppendResponse(nil, 201, http.Header{"Location": {"/v1/x"}, "A": {"1", "2"}}, []byte("body")))
	f.Add([]byte{200, 0})
	f.Add([]byte{0x80, 0x80})
	fw, err := flate.NewWriter(nil, flate.BestSpeed)
	require.NoError(f, err)
	f.Add(AppendCompressed(nil, 200, nil, bytes.Repeat([]byte("compressed "), 100), fw))
	f.Fuzz(func(t *testing.T, enc []byte) {
		n, err := HeadLen(enc)
		if err != nil {
			return
		}
		status, h := ParseHead(string(enc[:n]))
		again := AppendResponse(nil, status, h, enc[n:])
		status2, h2, body2 := decode(t, again)
		require.Equal(t, status, status2)
		require.Equal(t, h, h2)
		require.Equal(t, enc[n:], body2)
		// A compressed form reads back to a body that compresses to a form
		// that reads back the same, or fails as corrupt.
		st, body, err := Body(status, enc[n:])
		if err != nil {
			require.ErrorIs(t, err, ErrCorrupt)
			return
		}
		require.LessOrEqual(t, st, maxStatus)
		_, _, body3, err := ParseResponse(AppendCompressed(nil, st, h, body, fw))
		require.NoError(t, err)
		require.Equal(t, body, body3)
	})
}

// benchHeader is a typical stored response's header.
var benchHeader = http.Header{
	"Content-Type": {"application/json"},
	"Location":     {"/v1/charges/ch_3MmlLrLkdIwHu7ix0snN0B15"},
	"X-Request-Id": {"req_0d8f0c1b7a3e4d2f"},
}

func BenchmarkAppendResponse(b *testing.B) {
	body := make([]byte, 1024)
	b.ReportAllocs()
	for b.Loop() {
		AppendResponse(nil, http.StatusCreated, benchHeader, body)
	}
}

func BenchmarkParseResponse(b *testing.B) {
	enc := AppendResponse(nil, http.StatusCreated, benchHeader, make([]byte, 1024))
	b.ReportAllocs()
	for b.Loop() {
		n, err := HeadLen(enc)
		if err != nil {
			b.Fatal(err)
		}
		ParseHead(string(enc[:n]))
	}
}

// TestResponseFormPinned pins the bytes of one stored response: records
// written by earlier versions must keep reading the same, so a change to
// AppendResponse that alters them must fail here first.
func TestResponseFormPinned(t *testing.T) {
	const stored = "\xc9\x01" + // status 201
		"\x01" + // one header field
		"\x08Location" + "\x0d/v1/charges/1" +
		`{"id":1}`
	got := AppendResponse(nil, 201, http.Header{"Location": {"/v1/charges/1"}}, []byte(`{"id":1}`))
	assert.Equal(t, stored, string(got))
	status, h, body := decode(t, []byte(stored))
	assert.Equal(t, 201, status)
	assert.Equal(t, http.Header{"Location": {"/v1/charges/1"}}, h)
	assert.Equal(t, `{"id":1}`, string(body))
}
