package wire

import (
	"bytes"
	"compress/flate"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A compressible body is stored compressed and read back whole; one that
// does not shrink is stored plain.
func TestCompressedForm(t *testing.T) {
	fw, err := flate.NewWriter(nil, flate.BestSpeed)
	require.NoError(t, err)
	h := http.Header{"Content-Type": {"application/json"}}
	body := []byte(strings.Repeat(`{"id":"ch_1","amount":1200,"currency":"eur"},`, 200))
	enc := AppendCompressed(nil, 201, h, body, fw)
	assert.Less(t, len(enc), len(body)/4, "the compressed form")
	status, header, got, err := ParseResponse(enc)
	require.NoError(t, err)
	assert.Equal(t, 201, status)
	assert.Equal(t, h, header)
	assert.Equal(t, body, got)

	noise := make([]byte, 4096)
	x := uint64(88172645463325252)
	for i := range noise {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		noise[i] = byte(x)
	}
	plain := AppendCompressed(nil, 200, nil, noise, fw)
	assert.Equal(t, AppendResponse(nil, 200, nil, noise), plain, "a body compressing does not shorten")
}

// A compressed form whose length or data is damaged is refused, not read
// short or long.
func TestCompressedFormCorrupt(t *testing.T) {
	fw, err := flate.NewWriter(nil, flate.BestSpeed)
	require.NoError(t, err)
	body := bytes.Repeat([]byte("abcdefgh"), 1000)
	enc := AppendCompressed(nil, 200, nil, body, fw)
	n, err := HeadLen(enc)
	require.NoError(t, err)
	for name, bad := range map[string][]byte{
		"truncated":        enc[:len(enc)-3],
		"trailing bytes":   append(append([]byte(nil), enc...), 1, 2, 3),
		"length too large": append(append(append([]byte(nil), enc[:n]...), 0xff, 0xff, 0xff, 0xff, 0x0f), enc[n+2:]...),
		"length too small": append(append(append([]byte(nil), enc[:n]...), 0x10), enc[n+2:]...),
	} {
		_, _, _, err := ParseResponse(bad)
		assert.ErrorIs(t, err, ErrCorrupt, name)
	}
	// A status past the compressed range is no form at all.
	_, err = HeadLen(AppendResponse(nil, 2000, nil, nil))
	assert.ErrorIs(t, err, ErrCorrupt)
}

// BenchmarkCompressed measures the compressed form of a 10 KiB JSON body:
// writing it (a completion) and reading it (a replay).
func BenchmarkCompressed(b *testing.B) {
	fw, err := flate.NewWriter(nil, flate.BestSpeed)
	require.NoError(b, err)
	var body []byte
	for i := 0; len(body) < 10<<10; i++ {
		body = append(body, fmt.Sprintf(`{"id":"ch_%d","amount":%d,"currency":"eur","status":"succeeded"},`, i, 100+i*7)...)
	}
	body = body[:10<<10]
	enc := AppendCompressed(nil, 201, nil, body, fw)
	b.Run("write", func(b *testing.B) {
		for b.Loop() {
			AppendCompressed(nil, 201, nil, body, fw)
		}
	})
	b.Run("read", func(b *testing.B) {
		for b.Loop() {
			if _, _, _, err := ParseResponse(enc); err != nil {
				b.Fatal(err)
			}
		}
	})
}
