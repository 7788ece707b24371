"""Errors a user can cause while a document is read; each message is one line naming the file."""

from kvpage_cli.errors import IngestError

SUPPORTED_TYPES = "PDF, DOCX, TXT or MD"


class DocumentNotFound(IngestError):
    """The path does not exist."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"{name} does not exist")


class UnsupportedDocument(IngestError):
    """The file is of a type kvpage cannot read (an image, a spreadsheet, a legacy .doc ...)."""

    def __init__(self, name: str, hint: str = ""):
        self.name = name
        message = f"{name} is not a supported document type (use {SUPPORTED_TYPES})"
        super().__init__(message + (f"; {hint}" if hint else ""))


class EncryptedDocument(IngestError):
    """The PDF is encrypted and no (or a wrong) password was given."""

    def __init__(self, name: str, password_given: bool = False, reason: str = ""):
        self.name = name
        self.password_given = password_given
        if password_given and reason:
            message = f"{name} is encrypted and cannot be decrypted: {reason}"
        elif password_given:
            message = f"{name} is encrypted and the password is wrong"
        else:
            message = f"{name} is encrypted; pass --password" + (f" (also {reason})" if reason else "")
        super().__init__(message)


class NoTextLayer(IngestError):
    """The PDF has pages but no text in them (a scan or a picture of text)."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"{name} has no extractable text (it needs OCR)")


class BrokenDocument(IngestError):
    """The file is damaged or is not what its name says."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        super().__init__(f"{name} could not be read: {reason}")


class DocumentTooLarge(IngestError):
    """The input is beyond what kvpage reads: too many bytes, or text that inflates too far."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        super().__init__(f"{name} is too large to read: {reason}")


class EmptyDocument(IngestError):
    """The document was read but holds no text."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"{name} is empty: it holds no text to read")


class BinaryDocument(IngestError):
    """A file expected to be text holds binary data."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"{name} looks binary, not text")


class NothingReadable(IngestError):
    """A directory holds no file that could be read as text."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"{_as_directory(name)} has no readable text files")


class DirectoryNotAllowed(IngestError):
    """A directory was given where one file is expected."""

    def __init__(self, name: str, hint: str = "review takes one file"):
        self.name = name
        super().__init__(f"{_as_directory(name)} is a directory; {hint}")


def _as_directory(name: str) -> str:
    return name if name.endswith("/") else name + "/"
