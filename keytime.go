package idempotency

import (
	"encoding/hex"
	"net/http"
	"time"
)

// UUIDv7Time is a MiddlewareOptions.KeyTime for clients whose keys are
// UUIDv7s (RFC 9562), whose first 48 bits count the milliseconds since the
// Unix epoch at which the key was made. It reports false for any key that
// is not a UUIDv7 in its 36-character form (hex digits of either case), so
// such keys are served as if KeyTime were unset.
func UUIDv7Time(_ *http.Request, key string) (time.Time, bool) {
	if len(key) != 36 || key[8] != '-' || key[13] != '-' || key[18] != '-' || key[23] != '-' {
		return time.Time{}, false
	}
	var b [16]byte
	hexDigits := key[0:8] + key[9:13] + key[14:18] + key[19:23] + key[24:36]
	if _, err := hex.Decode(b[:], []byte(hexDigits)); err != nil {
		return time.Time{}, false
	}
	if b[6]>>4 != 7 || b[8]>>6 != 0b10 { // version 7, RFC 9562 variant
		return time.Time{}, false
	}
	var ms int64
	for _, c := range b[:6] {
		ms = ms<<8 | int64(c)
	}
	return time.UnixMilli(ms), true
}
