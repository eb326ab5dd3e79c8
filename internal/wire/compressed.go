package wire

import (
	"bytes"
	"compress/flate"
	"encoding/binary"
	"io"
	"net/http"
)

// A compressed form is the form of a response whose status is the
// response's plus compressedStatus, and whose body is the length of the
// response's body (an unsigned varint) and then the body compressed with
// DEFLATE. A reader of the plain form alone refuses its status as above
// maxStatus (ErrCorrupt) rather than replay compressed bytes.
const compressedStatus = 1000

// maxCompressedBody bounds the body a compressed form may claim to hold.
const maxCompressedBody = 1 << 28

// AppendCompressed appends to b the compressed form of a response,
// compressed by fw, or its plain form when compressing does not make it
// shorter. fw is reset for the body and left closed.
func AppendCompressed(b []byte, status int, header http.Header, body []byte, fw *flate.Writer) []byte {
	var z bytes.Buffer
	z.Grow(len(body) / 2)
	z.Write(binary.AppendUvarint(nil, uint64(len(body))))
	fw.Reset(&z)
	_, err := fw.Write(body)
	if err == nil {
		err = fw.Close()
	}
	if err != nil || z.Len() >= len(body) {
		return AppendResponse(b, status, header, body)
	}
	return AppendResponse(b, status+compressedStatus, header, z.Bytes())
}

// Body returns the status and the body of a response whose form's head
// ParseHead read as status and whose body in the form is rest: rest itself
// for the plain form, and the body decompressed for a compressed one.
func Body(status int, rest []byte) (int, []byte, error) {
	if status < compressedStatus {
		return status, rest, nil
	}
	n, w := binary.Uvarint(rest)
	if w <= 0 || n > maxCompressedBody {
		return 0, nil, ErrCorrupt
	}
	// flate reads a bytes.Reader a byte at a time, never past the stream's
	// end: bytes left after it are no part of the form. Past 1 MiB, what is
	// allocated grows with what is decompressed, not with a length that may
	// be corrupt.
	z := bytes.NewReader(rest[w:])
	body := bytes.NewBuffer(make([]byte, 0, min(n, 1<<20)))
	_, err := body.ReadFrom(io.LimitReader(flate.NewReader(z), int64(n)+1))
	if err != nil || uint64(body.Len()) != n || z.Len() != 0 {
		return 0, nil, ErrCorrupt
	}
	return status - compressedStatus, body.Bytes(), nil
}

// ParseResponse reads a whole form, plain or compressed: HeadLen, ParseHead
// and Body in one call, for a store that holds the form as bytes.
func ParseResponse(enc []byte) (status int, header http.Header, body []byte, err error) {
	n, err := HeadLen(enc)
	if err != nil {
		return 0, nil, nil, err
	}
	status, header = ParseHead(string(enc[:n]))
	status, body, err = Body(status, enc[n:])
	return status, header, body, err
}
