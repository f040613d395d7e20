"""The decode service (`Decode.Generate`): what runs in a decode pod."""
